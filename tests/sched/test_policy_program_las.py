"""Program-level least attained service on the pure scheduler (no model): programs with much service
yield to new ones, service outlives a program's finished calls until it goes idle, the starvation
bound, priority, and the scheduler's invariants after every step."""
from __future__ import annotations

import itertools
import random
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_scheduler import fake_token, reference_output

from segue.config import SchedulerConfig
from segue.kv.manager import KVCacheManager
from segue.request import Request, RequestStatus
from segue.sampling_params import SamplingParams
from segue.sched.policies import PolicyContext, make_policy
from segue.sched.policies.program_las import ProgramLASPolicy
from segue.sched.scheduler import Scheduler

STEP_S = 0.01


def make(options: dict[str, Any] | None = None, num_blocks: int = 64, block_size: int = 4, budget: int = 64,
         max_seqs: int = 8) -> tuple[Scheduler, ProgramLASPolicy]:
    kv = KVCacheManager(block_size, num_blocks, enable_prefix_caching=True)
    policy = make_policy("program-las", PolicyContext(options={"base_quantum": 16, **(options or {})}))
    assert isinstance(policy, ProgramLASPolicy)
    cfg = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_seqs)
    return Scheduler(cfg, kv, policy, max_model_len=num_blocks * block_size), policy


def req(rid: str, program: str | None, now: float, prompt: int = 8, max_tokens: int = 4, priority: int = 0,
        start: int = 0) -> Request:
    return Request(rid, list(range(start, start + prompt)), SamplingParams(max_tokens=max_tokens), now,
                   priority=priority, program_id=program)


def step(sched: Scheduler, now: float) -> list[str]:
    """One step with invariants checked; returns the ids that ran."""
    out = sched.schedule(now)
    sched.update_from_output(out, {s.request.request_id: fake_token(s.request) for s in out.seqs if s.sample})
    sched.check_invariants()
    return [s.request.request_id for s in out.seqs]


def run_until_done(sched: Scheduler, now: float, limit: int = 2000) -> float:
    for _ in range(limit):
        if not sched.has_unfinished_requests():
            return now
        step(sched, now)
        now += STEP_S
    raise AssertionError("the scheduler made no progress")


def test_program_with_much_service_yields_to_a_new_program() -> None:
    sched, policy = make(max_seqs=1)
    # Program "agent" has already had a long call: 40 prompt + 20 generated tokens, of which all but
    # the last (sampled, never computed) were service.
    sched.add_request(req("agent-1", "agent", 0.0, prompt=40, max_tokens=20))
    now = run_until_done(sched, 0.0)
    assert policy.attained(req("probe", "agent", now)) == 59  # kept after its call finished
    # Its next call arrives before a new program's call, and still waits for it.
    sched.add_request(req("agent-2", "agent", now, start=100))
    sched.add_request(req("fresh-1", "fresh", now + 0.001, start=200))
    order = []
    while sched.has_unfinished_requests():
        order += [r for r in step(sched, now) if not order or order[-1] != r]
        now += STEP_S
    assert order == ["fresh-1", "agent-2"]


def test_fcfs_contrast_and_preemption_by_a_new_program() -> None:
    sched, policy = make(max_seqs=1)
    sched.add_request(req("agent-1", "agent", 0.0, prompt=40, max_tokens=30))
    now = 0.0
    for _ in range(15):  # well into its decode: 40 + ~14 tokens of service
        assert step(sched, now) == ["agent-1"]
        now += STEP_S
    sched.add_request(req("fresh-1", "fresh", now, start=300))
    # Preemptive: the new program takes the next step; agent-1 keeps its KV while it waits.
    assert step(sched, now) == ["fresh-1"]
    assert sched.state.kv.num_device_blocks_of("agent-1") > 0
    run_until_done(sched, now + STEP_S)
    assert sched.state.requests == {} and sched.state.kv.num_held_blocks() == 0


def test_requests_without_a_program_are_their_own_program_and_leave_nothing_behind() -> None:
    sched, policy = make()
    for i in range(20):
        sched.add_request(req(f"anon-{i}", None, 0.0, start=10 * i))
    run_until_done(sched, 0.0)
    assert policy.programs == {} and policy.entries == {}


def test_idle_programs_are_forgotten_after_the_window() -> None:
    sched, policy = make({"forget_after_s": 1.0})
    sched.add_request(req("a-1", "a", 0.0))
    now = run_until_done(sched, 0.0)
    assert "p:a" in policy.programs
    step(sched, now + 0.5)  # idle, but within the window: still remembered
    assert "p:a" in policy.programs
    # A new call within the window continues the program's service.
    sched.add_request(req("a-2", "a", now + 0.6, start=50))
    now = run_until_done(sched, now + 0.6)
    assert policy.attained(req("probe", "a", now)) == 2 * (8 + 3)
    step(sched, now + 1.01)  # idle for longer than the window: forgotten
    assert policy.programs == {}


def test_starvation_bound_under_a_flood_of_new_programs() -> None:
    """One slot; a heavy program's call competes with a new program arriving every step. LAS alone
    would never run it; the wait/service ratio bounds its wait between services."""
    for ratio, min_wait, expect_served in ((5.0, 0.1, True), (1e9, 1e9, False)):
        sched, policy = make({"starvation_ratio": ratio, "min_starvation_wait_s": min_wait}, max_seqs=1,
                             num_blocks=256)
        sched.add_request(req("heavy-1", "heavy", 0.0, prompt=40, max_tokens=2))
        now = run_until_done(sched, 0.0)
        sched.add_request(req("heavy-2", "heavy", now, prompt=4, max_tokens=40, start=1000))
        served, last = [], now
        for i in range(150):
            sched.add_request(req(f"new-{i}", f"new-{i}", now, prompt=2, max_tokens=1, start=2000 + 3 * i))
            if "heavy-2" in step(sched, now):
                served.append(now)
            now += STEP_S
        if not expect_served:
            assert served == []
            continue
        assert served, "the heavy program's call never ran"
        entry = policy.entries.get("heavy-2")
        gaps = [b - a for a, b in itertools.pairwise([last] + served)]
        # Its own service is a handful of tokens at the default cost model: the bound is the floor
        # (or ratio x service), plus the step in which it is promoted.
        bound = max(min_wait, ratio * (entry.served_s if entry else 0.0)) + 2 * STEP_S
        assert max(gaps) <= bound, (gaps, bound)


def test_priority_breaks_ties_or_acts_as_a_class() -> None:
    sched, policy = make(max_seqs=1)
    sched.add_request(req("low", "p1", 0.0, priority=5))
    sched.add_request(req("high", "p2", 0.001, priority=0, start=100))
    assert step(sched, 0.0) == ["high"]  # equal (zero) service: lower priority value first

    # As a tie-breaker, priority does not beat less service; as a class it does.
    for as_class, first in ((False, "fresh"), (True, "vip-2")):
        sched, policy = make({"priority_as_class": as_class}, max_seqs=1)
        sched.add_request(req("vip-1", "vip", 0.0, prompt=40, max_tokens=20, priority=-1))
        now = run_until_done(sched, 0.0)
        sched.add_request(req("vip-2", "vip", now, priority=-1, start=100))
        sched.add_request(req("fresh", "fresh", now, priority=0, start=200))
        assert step(sched, now) == [first]


def test_unknown_options_are_rejected() -> None:
    with pytest.raises(ValueError, match="unknown program-las options"):
        make({"quantum": 3})
    with pytest.raises(ValueError, match="service_unit"):
        make({"service_unit": "joules"})


def test_time_service_unit_uses_the_cost_model() -> None:
    sched, policy = make({"service_unit": "time", "base_quantum": 0.01})
    sched.add_request(req("a-1", "a", 0.0, prompt=8, max_tokens=3))
    run_until_done(sched, 0.0)
    cost = policy.context.cost
    # The prefill chunk and two decodes (the last sampled token is never computed).
    assert policy.attained(req("probe", "a", 0.0)) == pytest.approx(cost.t_fwd(8) + 2 * cost.t_fwd(1))


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10_000), num_blocks=st.integers(10, 40), budget=st.integers(4, 40))
def test_random_programs_with_pauses_keep_invariants_and_outputs(seed: int, num_blocks: int, budget: int) -> None:
    rng = random.Random(seed)
    sched, policy = make({"min_starvation_wait_s": 0.05}, num_blocks=num_blocks, budget=budget,
                         max_seqs=rng.randrange(1, 6))
    pending = []
    for i in range(rng.randrange(2, 14)):
        prompt, max_tokens = rng.randrange(1, 14), rng.randrange(1, 8)
        if prompt + max_tokens + 4 > sched.state.max_model_len:
            continue
        program = rng.choice([None, "a", "b", "c"])
        pending.append(req(f"r{i}", program, 0.0, prompt=prompt, max_tokens=max_tokens, start=rng.randrange(30),
                           priority=rng.randrange(3)))
    reqs, aborted, now = list(pending), set(), 0.0
    while pending or sched.has_unfinished_requests():
        if pending and rng.random() < 0.5:
            sched.add_request(pending.pop(0))
        running = [r for r in sched.state.running if r.num_output_tokens]
        if running and rng.random() < 0.1:
            sched.intercept_request(rng.choice(running), now)
        for r in list(sched.state.paused.paused.values()):
            if rng.random() < 0.3:
                sched.resume_request(r, [], now)
        if sched.state.requests and rng.random() < 0.03:
            rid = rng.choice(sorted(sched.state.requests))
            sched.abort_request(rid)
            aborted.add(rid)
        sched.check_invariants()
        step(sched, now)
        now += STEP_S
        assert now < 50, "the scheduler made no progress"
    assert sched.state.kv.num_held_blocks() == 0 and policy.entries == {}
    for r in reqs:
        if r.request_id in aborted:
            assert r.status == RequestStatus.FINISHED_ABORTED
        else:
            assert r.status == RequestStatus.FINISHED_LENGTH
            assert r.output_token_ids == reference_output(r.prompt_token_ids, r.sampling_params.max_tokens)
