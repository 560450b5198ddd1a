"""Agents of plain clients: identity through the token chain, histories retained across the tool
gap, and admission that does not evict them for newcomers (issue 25). KV invariants every step."""
from __future__ import annotations

import functools

import sched_helpers
from sched_helpers import BS, SLOW, run_until_done, step
from segue.config import SchedulerConfig
from segue.kv.manager import KVCacheManager
from segue.request import RequestStatus
from segue.sched.cost_model import CostModel
from segue.sched.policies import make_policy
from segue.sched.scheduler import Scheduler

# A turn decodes 4 tokens unless told otherwise.
turn = functools.partial(sched_helpers.turn, max_tokens=4)


def make_scheduler(num_blocks: int, budget: int = 64, retention: bool = True,
                   cost: CostModel | None = None) -> Scheduler:
    kv = KVCacheManager(BS, num_blocks)
    cfg = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=8, agent_retention=retention)
    return Scheduler(cfg, kv, make_policy("fcfs"), max_model_len=num_blocks * BS, cost=cost)


def test_retained_context_survives_and_is_hit_by_the_next_turn():
    kv = KVCacheManager(BS, 16)
    req = turn("a", list(range(10)), 0.0)
    assert kv.allocate_slots(req, 10)
    req.num_computed_tokens = 10
    kv.cache_full_blocks(req)
    handle = kv.retain(req)
    kv.check_invariants()
    # Two full blocks stay held (not free); the partial third went back to the pool.
    assert handle is not None and handle.num_blocks == 2 and handle.num_private_blocks() == 2
    assert kv.num_free_blocks == 14 and kv.num_retained_blocks == 2
    nxt = turn("a2", list(range(10)) + [40, 41, 42], 1.0)
    hit = kv.match(nxt)
    assert hit.num_tokens == 8 and hit.block_ids == [b.block_id for b in handle.blocks]
    assert kv.release_retained(handle) == 2
    assert kv.release_retained(handle) == 0  # a second release is a no-op
    kv.check_invariants()
    # Released, the blocks are evictable but still findable.
    assert kv.match(turn("a3", list(range(10)), 2.0)).num_tokens == 8


def test_a_turn_that_extends_a_finished_one_belongs_to_its_agent():
    sched = make_scheduler(32)
    first = turn("t0", list(range(12)), 0.0)
    sched.add_request(first)
    now = run_until_done(sched, first, 0.0)
    agent = None
    assert sched.state.agents.gaps.p_return() == 0.5  # no evidence yet: retained
    assert sched.state.kv.num_retained_blocks > 0
    later = turn("t1", first.all_token_ids + [30, 31, 32, 33], now + 2.0)
    sched.state.now = now + 2.0
    sched.add_request(later)
    agent = sched.state.agents.agent_of(later)
    assert agent is not None and agent.turns == 2 and sched.state.agents.is_resident(later)
    assert abs(sched.state.agents.gaps.mean() - 2.0) < 0.2
    stranger = turn("s0", [45, 46, 47, 48, 49], now + 2.0)
    sched.add_request(stranger)
    assert sched.state.agents.agent_of(stranger).turns == 1 and not sched.state.agents.is_resident(stranger)
    run_until_done(sched, later, now + 2.0)
    # The next turn prefilled only what the history did not hold.
    assert later.num_cached_tokens >= 12


def test_newcomer_waits_instead_of_evicting_a_retained_history():
    # 12 blocks: agent A's history takes 6 when retained; a newcomer that needs 8 must wait.
    sched = make_scheduler(12, cost=SLOW)
    a0 = turn("a0", list(range(22)), 0.0, max_tokens=3)
    sched.add_request(a0)
    now = run_until_done(sched, a0, 0.0)
    assert sched.state.kv.num_retained_blocks == 6
    other = turn("x", list(range(100, 102)), now, max_tokens=12)  # keeps something running
    big = turn("b0", list(range(200, 228)), now, max_tokens=3)
    sched.add_request(other)
    sched.add_request(big)
    for _ in range(2):
        ran = step(sched, now)
        now += 0.1
        assert big not in ran, "the newcomer evicted a retained history"
    assert sched.state.kv.num_retained_blocks == 6
    # A's next turn arrives and runs on its whole retained history.
    a1 = turn("a1", a0.all_token_ids + [60, 61, 62], now, max_tokens=2)
    sched.add_request(a1)
    now = run_until_done(sched, a1, now)
    assert a1.num_cached_tokens == 24
    # The newcomer runs once memory is free (A's context again retained: it waits it out, bounded).
    run_until_done(sched, big, now)
    assert big.status is RequestStatus.FINISHED_LENGTH
    assert sched.state.num_preemptions_total == 0


def test_starving_newcomer_takes_retained_memory():
    sched = make_scheduler(12, cost=SLOW)
    a0 = turn("a0", list(range(22)), 0.0, max_tokens=3)
    sched.add_request(a0)
    now = run_until_done(sched, a0, 0.0)
    # Something runs for a long time, so the newcomer is never alone in the pool.
    runner = turn("r", [90, 91], now, max_tokens=40)
    big = turn("b0", list(range(200, 228)), now, max_tokens=3)
    sched.add_request(runner)
    sched.add_request(big)
    # Its bound: A's history recomputed (6 blocks of 4 tokens at 100 ms), within the usual gap.
    bound = min(sched.state.agents.gaps.quantile(0.9), SLOW.t_fwd_extra(6 * BS))
    t0 = now
    while not big.is_finished:
        step(sched, now)
        now += 0.1
        assert now - t0 < bound + 2.0, "the newcomer starved past the bound"
    assert now - t0 >= 1.0  # it did wait for the retained history first (its shortfall's recompute)


def test_one_off_requests_stop_being_retained():
    sched = make_scheduler(64)
    now = 0.0
    for i in range(8):
        req = turn(f"q{i}", [i * 5 + k for k in range(8)], now)
        sched.add_request(req)
        now = run_until_done(sched, req, now)
        now += 25.0  # longer than twice the prior gap: counted as not continued
        step(sched, now)
    assert sched.state.agents.gaps.p_return() < 0.5
    req = turn("last", [300 + k for k in range(8)], now)
    sched.add_request(req)
    run_until_done(sched, req, now)
    assert sched.state.kv.num_retained_blocks == 0


def test_running_requests_are_not_preempted_for_a_retained_history():
    # A retained context goes before a running request gives up its KV.
    sched = make_scheduler(10, budget=64)
    a0 = turn("a0", list(range(16)), 0.0, max_tokens=1)
    sched.add_request(a0)
    now = run_until_done(sched, a0, 0.0)
    assert sched.state.kv.num_retained_blocks == 4
    grower = turn("g", [80, 81, 82], now, max_tokens=20)  # grows to 6 blocks
    sched.add_request(grower)
    run_until_done(sched, grower, now)
    assert sched.state.num_preemptions_total == 0 and grower.status is RequestStatus.FINISHED_LENGTH


def test_off_keeps_the_old_behaviour():
    sched = make_scheduler(32, retention=False)
    req = turn("a", list(range(12)), 0.0)
    sched.add_request(req)
    run_until_done(sched, req, 0.0)
    assert sched.state.agents is None and sched.state.kv.num_held_blocks() == 0
    assert sched.state.kv.device.num_free_blocks == 32


def test_a_turn_aborted_while_waiting_lets_its_agents_history_go_at_once():
    sched = make_scheduler(32)
    a0 = turn("a0", list(range(12)), 0.0)
    sched.add_request(a0)
    now = run_until_done(sched, a0, 0.0)
    assert sched.state.kv.num_retained_blocks > 0
    a1 = turn("a1", a0.all_token_ids + [30, 31], now)
    sched.add_request(a1)
    agent = sched.state.agents.agent_of(a1)
    assert agent is not None and sched.state.agents.is_resident(a1)
    sched.abort_request("a1")  # its next turn will not come (the client went away)
    sched.check_invariants()
    assert agent.context is None and sched.state.kv.num_retained_blocks == 0
    assert sched.state.kv.num_free_blocks == sched.state.kv.num_blocks
    step(sched, now + 0.1)  # nothing of it is left for expire() to find
    assert sched.state.kv.num_free_blocks == sched.state.kv.num_blocks
