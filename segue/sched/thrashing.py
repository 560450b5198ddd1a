"""Thrashing avoidance for admission (issue 25): a request starts (or a held context rejoins the
running requests) only when the rest of its prompt and its expected output fit beside what the
running requests still need and the histories retained for agents expected back (sched/agents.py).

Started in a pool it cannot finish in, a prompt's prefill grows into a preemption (a running
request recomputes); admitted into retained histories, it evicts what their next turns must then
recompute. On the pressure preset (32 agents whose histories add up to ~3x an 8,192-token pool,
real engine) admitting without this test cost 47-170 preemptions a run; with it, none, and
1.10-1.24x less agent time (BENCHMARKS.md). A turn whose own history is retained, and a request
that has waited past its starvation bound, may release others' histories, the least valuable
first, and only when that lets it in; so may a new agent's first turn past the newcomer bound
(sched/newcomers.py). Paused contexts (a tool call's, a session's turn waiting on its client) are
released only for a request that holds its own context, as a running request's growth would take
them, never for a timer: what they are worth is the interception policy's to weigh (min-waste: the
recompute against what holding costs), and a bound on a newcomer's wait knows nothing of it.
Non-preemptive orders only (sched/admission.py). Pure Python.
"""
from __future__ import annotations

import enum
import math

from segue.kv.interface import PrefixHit
from segue.request import Request, RequestStatus
from segue.sched.memory import free_for_thrashing
from segue.sched.memory_table import Source
from segue.sched.newcomers import is_overdue
from segue.sched.state import SchedulerState


def expected_output(req: Request, block_size: int) -> int:
    """Tokens a request is expected to generate from now on: the predicted length (segue/predict)
    within max_tokens; without a prediction, one block of growth, not max_tokens (a chat request
    that names none may generate 1,024 tokens but rarely does: reserving them all would admit a
    few requests at a time; a wrong guess costs a preemption, as without this reservation)."""
    left = max(0, req.sampling_params.max_tokens - req.num_generated_tokens)
    if req.predicted_output_tokens is None:
        return min(left, block_size)
    return min(left, math.ceil(req.predicted_output_tokens))


def still_needed(sched: SchedulerState, req: Request) -> int:
    """Device blocks an admitted request will still take: the rest of its prompt and its output."""
    kv = sched.kv
    return kv.num_blocks_needed(req, req.num_tokens - req.num_computed_tokens + expected_output(req, kv.block_size))


def running_needs(sched: SchedulerState) -> int:
    """Device blocks the running requests will still take (their `still_needed`, summed)."""
    return sum(still_needed(sched, r) for r in sched.running)


def _shortfall(sched: SchedulerState, req: Request, hit: PrefixHit, committed: int) -> int:
    """Blocks missing for the rest of the request (its cached hit attached), beside `committed` ones."""
    kv = sched.kv
    rest = req.num_tokens - req.num_computed_tokens + expected_output(req, kv.block_size)
    need = kv.num_blocks_needed(req, rest) - hit.num_blocks
    room = kv.counters().num_free_blocks - hit.num_free() - committed
    return need - room


class Fit(enum.Enum):
    """What admission may do with a request without KV beside the agents' retained histories."""
    FITS = "fits"          # it may go on to allocate
    WAITS = "waits"        # not yet: later candidates may still run
    STARVES = "starves"    # past its starvation bound and still short: it keeps what frees up


def _past_bound(sched: SchedulerState, req: Request, shortfall: int) -> bool:
    """The starvation bound: a newcomer waits for retained histories no longer than recomputing
    what it would take from them (`shortfall` blocks) costs, nor than agents usually stay away
    (by then most are back or gone)."""
    agents = sched.agents
    assert agents is not None
    tokens = max(0, shortfall) * sched.kv.block_size
    bound = min(agents.gaps.quantile(0.9), sched.cost.t_prefill(tokens))
    return sched.now - req.arrival_time >= bound


def fit_beside_agents(sched: SchedulerState, req: Request, hit: PrefixHit, committed: int,
                      alone: bool) -> Fit:
    """Whether a waiting request may start now (its cached `hit` attached): one without KV, or
    one that holds its context (a session's turn resumed after its tool, whose appended tokens
    and output grow it as much as a plain client's next prompt would). Retained histories are
    released for it when its own history is retained or held, or it is past its bound; a held
    one also takes other paused requests' contexts, as a running request's growth would. A
    newcomer past the newcomer bound takes retained histories only: paused contexts are the
    interception policy's (on the InferCept trace every plain request is a newcomer, and releasing
    preserved tool calls for overdue ones cost min-waste 3 % and swap 10 % normalized latency at
    8 req/s; BENCHMARKS.md). A request `alone` (nothing else runs or was admitted this
    step) always may: nothing else would ever free memory for it."""
    agents = sched.agents
    assert agents is not None
    short = _shortfall(sched, req, hit, committed)
    if alone or short <= 0:
        return Fit.FITS
    overdue = is_overdue(sched, req)
    past = overdue or _past_bound(sched, req, short)
    holds = req.num_computed_tokens > 0
    allowed = set()
    if holds:  # not `or overdue`: a timer never decides a paused context's fate (see the docstring)
        allowed.add(Source.PAUSED)
    if past or holds or agents.is_resident(req):
        allowed.add(Source.HISTORIES)
    left = free_for_thrashing(sched, hit, lambda: _shortfall(sched, req, hit, committed), frozenset(allowed),
                              agents.agent_of(req))
    if left <= 0:
        return Fit.FITS
    past = overdue or _past_bound(sched, req, left)
    return Fit.STARVES if past else Fit.WAITS


def rejoin_resident(sched: SchedulerState, committed: int | None) -> None:
    """Non-preemptive policies: a waiting request that still holds its context on the device
    (a preserved pause that ended, a finished swap-in) rejoins the running requests, as
    InferCept keeps it in vLLM's running queue, instead of queueing for admission. Queued
    behind cheaper work by an ordering like LAMPS's, it would pin memory it cannot use: with
    it in the waiting queue, waiting holders kept 55% of the pool on average and LAMPS
    preempted 7x as often as FCFS (simulator, 30 minutes at 4 req/s; BENCHMARKS.md). Under
    memory pressure it is preempted like any running request, in the policy's order. With
    thrashing avoidance on (`committed`: what the running requests still need), only one that
    fits beside them; admission decides about the others (fit_beside_agents), or it grows into a
    preemption."""
    for req in sched.policy.order(sched.waiting_holders(), sched.now):
        if req.num_computed_tokens > 0 and len(sched.running) < sched.config.max_num_seqs:
            if committed is not None:
                need = still_needed(sched, req)
                if sched.running and need > sched.kv.counters().num_free_blocks - committed:
                    continue
                committed += need
            sched.waiting.remove(req)
            req.status = RequestStatus.RUNNING
            sched.running.append(req)
