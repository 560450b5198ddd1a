"""Thrashing avoidance releases other agents' KV only for a request that the release lets in: a
release that leaves it waiting would throw away histories and paused contexts for nothing, and
again at the next step (sched/thrashing.py). KV invariants every step."""
from __future__ import annotations

from sched_helpers import BS, SLOW, finish, step, turn
from segue.config import SchedulerConfig
from segue.kv.interface import NO_HIT
from segue.kv.manager import KVCacheManager
from segue.request import RequestStatus
from segue.sched.interception import make_interception_policy
from segue.sched.policies import make_policy
from segue.sched.scheduler import Scheduler
from segue.sched.thrashing import _shortfall, running_needs


def make_scheduler(num_blocks: int) -> Scheduler:
    kv = KVCacheManager(BS, num_blocks)
    cfg = SchedulerConfig(max_num_batched_tokens=128, max_num_seqs=8, agent_retention=True)
    return Scheduler(cfg, kv, make_policy("fcfs"), max_model_len=num_blocks * BS, cost=SLOW,
                     interception=make_interception_policy("preserve"))


def test_a_resident_turn_that_would_still_not_fit_releases_no_other_history():
    sched = make_scheduler(20)
    now = finish(sched, turn("a0", list(range(22)), 0.0), 0.0)       # A: 6 blocks retained
    b0 = turn("b0", list(range(300, 310)), now)
    now = finish(sched, b0, now)                                      # B: 3 blocks retained
    agents = sched.state.agents._agents.values()
    agent_a = next(a for a in agents if a.context is not None and a.context.num_blocks == 6)
    assert sched.state.kv.num_retained_blocks == 9
    runner = turn("r", [90, 91], now, max_tokens=60)                  # never alone in the pool
    sched.add_request(runner)
    step(sched, now)
    now += 0.1
    # B's next turn continues its retained history (it may release others'), but even A's whole
    # history would not make room for it beside the runner.
    b1 = turn("b1", b0.all_token_ids + list(range(400, 460)), now)
    sched.add_request(b1)
    assert sched.state.agents.is_resident(b1)
    hit = sched.state.kv.match(b1)
    assert _shortfall(sched.state, b1, hit, running_needs(sched.state)) > agent_a.context.num_private_blocks()
    for _ in range(4):  # within the bound and past it: waiting or starving, it takes nothing
        assert b1 not in step(sched, now)
        now += 0.1
        assert agent_a.context is not None and sched.state.kv.num_retained_blocks == 9
    assert b1.status is RequestStatus.WAITING


def test_a_held_context_that_would_still_not_fit_releases_no_paused_context():
    sched = make_scheduler(20)
    runner = turn("r", [90, 91], 0.0, max_tokens=60)
    paused = turn("p", list(range(100, 106)), 0.0, max_tokens=10)
    held = turn("s", list(range(200, 206)), 0.0, max_tokens=40)
    for req in (runner, paused, held):
        sched.add_request(req)
    step(sched, 0.0)
    sched.intercept_request(paused, 0.1)
    sched.intercept_request(held, 0.1)
    # The session's next turn: 66 appended tokens, more than the paused context's blocks free.
    sched.resume_request(held, list(range(500, 566)), 0.2)
    private = sched.state.kv.num_private_blocks_of("p")
    assert private > 0
    state = sched.state
    assert _shortfall(state, held, NO_HIT, running_needs(state)) > private + state.kv.num_retained_blocks
    now = 0.2
    for _ in range(4):
        assert held not in step(sched, now)
        now += 0.1
        assert sched.state.kv.num_private_blocks_of("p") == private, "a paused context was released for nothing"
    assert held.status is RequestStatus.WAITING and paused.status is RequestStatus.INTERCEPTED
