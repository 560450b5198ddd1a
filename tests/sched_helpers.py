"""Helpers shared by scheduler tests that drive a Scheduler by hand over a small KV pool: a step
that samples token 7 for every sampling row and checks the KV invariants, a turn, and running a
request to its end."""
from __future__ import annotations

from segue.request import Request
from segue.sampling_params import SamplingParams
from segue.sched.cost_model import CostModel
from segue.sched.scheduler import Scheduler

BS = 4
# Recompute this slow (100 ms a token) makes a retained history worth a newcomer's wait of
# seconds: the starvation bound is the recompute time of what the newcomer would take.
SLOW = CostModel(fwd_ms_per_token=100.0, fwd_base_ms=10.0)


def step(sched: Scheduler, now: float) -> list[Request]:
    out = sched.schedule(now)
    sched.update_from_output(out, {s.request.request_id: 7 for s in out.seqs if s.sample})
    sched.check_invariants()
    return [s.request for s in out.seqs]


def turn(rid: str, prompt: list[int], now: float, max_tokens: int = 3) -> Request:
    return Request(rid, list(prompt), SamplingParams(max_tokens=max_tokens, ignore_eos=True), now)


def run_until_done(sched: Scheduler, req: Request, now: float) -> float:
    while not req.is_finished:
        step(sched, now)
        now += 0.1
        assert now < 1000, "no progress"
    return now


def finish(sched: Scheduler, req: Request, now: float) -> float:
    sched.add_request(req)
    return run_until_done(sched, req, now)
