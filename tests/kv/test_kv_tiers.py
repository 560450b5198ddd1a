"""Prefix-aware, tiered KV retention (issue 19): dispositions act on a paused request's private
blocks only, a discard releases blocks into the prefix cache instead of destroying them, the host
pool is a second tier of the prefix cache that any request hits, and abandoned pauses let go of
device memory. Every scheduler run checks the KV invariants after each step and the fake executor
checks the content of every KV slot that a step reads."""
from __future__ import annotations

import math
import random

import pytest

from fake_executor import FakeKVExecutor
from segue.config import CacheConfig, EngineConfig, SchedulerConfig
from segue.engine.engine_request import EngineRequest
from segue.kv.block_pool import BlockPool
from segue.kv.manager import KVCacheManager
from segue.request import Disposition, Request, RequestStatus
from segue.sampling_params import SamplingParams
from segue.sched.cost_model import CostModel
from segue.sched.interception import INTERCEPTION_POLICIES, make_interception_policy
from segue.sched.policies import make_policy
from segue.sched.scheduler import Scheduler
from segue.sim.engine import make_sim_engine
from segue.sim.script import scripted
from segue.sim.trace import TraceSegment

BS = 4
SYSTEM = list(range(100, 112))  # three full blocks every agent shares


def make(policy: str, device_blocks: int = 40, host_blocks: int = 40, budget: int = 64,
         fwd_ms_per_token: float = 1.0, agent_retention: bool = True) -> tuple[Scheduler, FakeKVExecutor]:
    kv = KVCacheManager(BS, device_blocks, host_blocks)
    # A fast link: the whole context fits in one step's swap limit.
    cost = CostModel(fwd_ms_per_token=fwd_ms_per_token, fwd_base_ms=5.0, saturation_tokens=16,
                     swap_bytes_per_s=1e9, kv_bytes_per_token=100)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=8, agent_retention=agent_retention),
                      kv, make_policy("fcfs"),
                      max_model_len=200, interception=make_interception_policy(policy), cost=cost)
    return sched, FakeKVExecutor(BS)


def step(sched: Scheduler, ex: FakeKVExecutor, now: float):
    out = sched.schedule(now)
    got = sched.update_from_output(out, ex.execute(out))
    sched.check_invariants()
    return out, got


def agent(rid: str, own: list[int], max_tokens: int = 8, t: float = 0.0) -> Request:
    return Request(rid, SYSTEM + own, SamplingParams(max_tokens=max_tokens), t)


def run_until_generated(sched, ex, req: Request, n: int, now: float) -> float:
    while req.num_generated_tokens < n:
        now += 0.01
        step(sched, ex, now)
    return now


def test_swap_out_takes_the_private_tail_never_a_shared_prefix():
    kv = KVCacheManager(BS, 20, 20)
    a = Request("a", SYSTEM + [1, 2, 3, 4, 5, 6, 7], SamplingParams(max_tokens=4), 0.0)
    b = Request("b", SYSTEM + [9, 9, 9, 9, 9], SamplingParams(max_tokens=4), 0.0)
    assert kv.allocate_slots(a, a.num_tokens)
    a.num_computed_tokens = a.num_tokens
    kv.cache_full_blocks(a)
    hit = kv.match(b)
    assert hit.num_blocks == 3 and kv.allocate_slots(b, b.num_tokens - 12, hit)
    table = list(kv.tables["a"])
    assert kv.num_private_blocks_of("a") == 2 and kv.private_device_tokens(a) == 7
    copies = kv.swap_out(a, 10).copies
    assert [d for d, _ in copies] == [b.block_id for b in table[3:]]
    assert kv.tables["a"] == table[:3] and all(blk.ref_cnt == 2 for blk in table[:3])
    assert kv.num_private_blocks_of("a") == 0 and kv.swap_out(a, 10).copies == []
    kv.check_invariants()


def test_paused_agents_sharing_a_system_prompt_never_move_or_drop_it():
    """Under every acting policy, a paused agent's disposition leaves the shared system prompt on
    the device, referenced by the agent that still runs, and no copy touches its blocks."""
    for policy in ("swap", "discard", "min-waste", "ttl", "lamps"):
        sched, ex = make(policy)
        a, b = agent("a", [1, 2, 3, 4, 5], max_tokens=30), agent("b", [7, 7, 7, 7, 7], max_tokens=30)
        sched.add_request(a)
        now = run_until_generated(sched, ex, a, 2, 0.0)
        sched.add_request(b)
        now = run_until_generated(sched, ex, b, 1, now)
        system_blocks = sched.state.kv.tables["a"][:3]
        assert sched.state.kv.tables["b"][:3] == system_blocks
        sched.intercept_request(a, now, tool="t", expected_s=100.0)
        for _ in range(5):
            now += 0.01
            out, _ = step(sched, ex, now)
            ids = {blk.block_id for blk in system_blocks}
            assert not ids & {d for d, _ in out.blocks_to_swap_out}, policy
        assert sched.state.kv.tables["b"][:3] == system_blocks and all(blk.ref_cnt >= 1 for blk in system_blocks)
        if policy != "ttl":  # ttl keeps it for the tool's time (capped at 30 s)
            assert sched.state.paused.device_tokens(a) == 0, policy  # nothing of its own left to act on
        assert sched.state.paused.held_device_blocks() == sched.state.kv.num_private_blocks_of("a")


def test_discarded_request_resumed_with_its_blocks_cached_recomputes_nothing():
    sched, ex = make("discard")
    a = Request("a", list(range(15)), SamplingParams(max_tokens=6), 0.0)
    sched.add_request(a)
    now = run_until_generated(sched, ex, a, 2, 0.0)
    assert a.num_computed_tokens == 16  # four full blocks; the newest token is not computed yet
    sched.intercept_request(a, now)
    now += 0.01
    step(sched, ex, now)
    assert a.interception.disposition is Disposition.DISCARD and not sched.state.kv.tables.get("a")
    assert sched.state.kv.device.num_free_blocks == sched.state.kv.device.num_blocks
    sched.resume_request(a, [60, 61, 62], now)
    now += 0.01
    out, _ = step(sched, ex, now)
    seq = out.seqs[0]
    assert seq.start_pos == 16 and sched.state.last_step_recompute_tokens == 0
    while not a.is_finished:
        now += 0.01
        step(sched, ex, now)
        assert sched.state.last_step_recompute_tokens == 0


def test_host_tier_is_hit_by_another_request():
    sched, ex = make("swap")
    a = Request("a", list(range(30)), SamplingParams(max_tokens=8), 0.0)
    sched.add_request(a)
    now = run_until_generated(sched, ex, a, 2, 0.0)
    sched.intercept_request(a, now)
    for _ in range(2):  # swap out, then the copies complete and the host blocks get published
        now += 0.01
        step(sched, ex, now)
    assert sched.state.kv.num_host_blocks_of("a") == 8 and not sched.state.kv.tables.get("a")
    sched.state.kv.device.reset_prefix_cache()  # the device copies are gone: only the host tier has them
    b = Request("b", list(range(30)) + [77, 78], SamplingParams(max_tokens=3), now)
    sched.add_request(b)
    now += 0.01
    out, _ = step(sched, ex, now)
    assert b.status is RequestStatus.SWAPPED and b.num_cached_tokens == 28  # 7 full blocks
    assert len(out.blocks_to_swap_in) == 7 and not out.seqs  # it runs once the copies are done
    assert sched.state.kv.num_host_blocks_of("a") == 8  # the owner still has its own
    while not b.is_finished:
        now += 0.01
        out, _ = step(sched, ex, now)  # the fake executor checks every KV slot b attends to
        assert sched.state.last_step_recompute_tokens == 0
    assert b.output_token_ids and b.num_cached_tokens == 28
    sched.resume_request(a, [5, 5], now)
    while not a.is_finished:
        now += 0.01
        step(sched, ex, now)


def test_abandoned_held_request_releases_device_memory_and_stays_resumable():
    sched, ex = make("preserve")
    a = Request("a", list(range(22)), SamplingParams(max_tokens=8), 0.0)
    sched.add_request(a)
    now = run_until_generated(sched, ex, a, 3, 0.0)
    sched.intercept_request(a, now)
    now += 0.01
    step(sched, ex, now)
    assert sched.state.kv.num_device_blocks_of("a") == 6  # preserve holds it
    assert sched.abandon("a") and not sched.abandon("nobody")
    assert sched.state.kv.num_device_blocks_of("a") == 0
    assert sched.state.kv.device.num_free_blocks == sched.state.kv.device.num_blocks
    assert sched.state.paused.held_device_blocks() == 0
    # Released, not destroyed: a resume before eviction revives every full block.
    sched.resume_request(a, [50], now)
    now += 0.01
    out, _ = step(sched, ex, now)
    assert out.seqs[0].start_pos == 24 and sched.state.last_step_recompute_tokens == 0
    while not a.is_finished:
        now += 0.01
        step(sched, ex, now)


def test_set_expected_resume_feeds_the_policy_estimate():
    sched, ex = make("min-waste")
    a = Request("a", list(range(22)), SamplingParams(max_tokens=8), 0.0)
    sched.add_request(a)
    now = run_until_generated(sched, ex, a, 3, 0.0)
    sched.intercept_request(a, now)
    assert sched.set_expected_resume("a", now + 2.5)
    assert a.interception.expected_duration == pytest.approx(2.5)
    assert sched.state.paused.expected_resume_at(a, now + 1.0) == pytest.approx(now + 2.5)
    assert not sched.set_expected_resume("nobody", 1.0)


def test_eviction_order_hashless_abandoned_lru_then_furthest_expected_reuse():
    pool = BlockPool(8)
    blocks = pool.allocate(8)
    for i, blk in enumerate(blocks[1:], 1):
        pool.register(blk, 1000 + i, (i,))
    pool.free([blocks[0]])                       # no hash
    pool.free([blocks[1], blocks[2]])            # finished request: LRU, freed in this order
    pool.free([blocks[3]], [math.inf])           # abandoned
    pool.free([blocks[4], blocks[5]], [50.0, 10.0])  # a paused request back at ~10-50 s
    pool.free([blocks[6]], [30.0])
    order = [pool.allocate(1)[0].block_id for _ in range(7)]
    assert order == [0, 3, 1, 2, 4, 6, 5]
    pool.check_invariants({7: 1, **{b: 1 for b in order}})


def test_release_keeps_a_context_head_longer_than_its_tail():
    kv = KVCacheManager(BS, 6, 0)
    a = Request("a", list(range(16)), SamplingParams(max_tokens=2), 0.0)
    assert kv.allocate_slots(a, 16)
    a.num_computed_tokens = 16
    kv.cache_full_blocks(a)
    ids = kv.block_ids("a")
    kv.release(a, reuse_at=5.0, block_recompute_s=0.1)
    assert a.num_computed_tokens == 0
    evicted = [b.block_id for b in kv.device.allocate(6)]
    assert evicted[2:] == list(reversed(ids))  # two hash-less first, then the tail before the head


@pytest.mark.parametrize("order", ["fcfs", "mlfq"])
@pytest.mark.parametrize("policy", sorted(INTERCEPTION_POLICIES))
def test_agents_sharing_a_system_prompt_in_the_simulator(policy, order):
    """Agents with one long system prompt, tool pauses and a held last turn, on a pool that holds
    a few of them: every request finishes, nothing leaks, invariants hold after every step."""
    rng = random.Random(7)
    system = [rng.randrange(1000, 40000) for _ in range(200)]
    config = EngineConfig(cache=CacheConfig(block_size=16, swap_space_tokens=1024),
                          scheduler=SchedulerConfig(max_num_batched_tokens=256, max_num_seqs=32, policy=order,
                                                    interception_policy=policy))
    engine = make_sim_engine(CostModel(), 1024, config, max_model_len=2048)
    for a in range(10):
        script = [TraceSegment(8, rng.uniform(0.5, 3.0), [rng.randrange(1000, 40000) for _ in range(60)], kind="tool")
                  for _ in range(rng.randint(2, 4))] + [TraceSegment(8, 20.0, [1]), TraceSegment(1)]
        scripted(engine).add_request(EngineRequest(system + [rng.randrange(1000, 40000) for _ in range(30)],
                                                   SamplingParams(temperature=0), f"a{a}",
                                                   arrival_time=engine.clock() + a * 0.3), script)
    for _ in range(200_000):
        if not engine.has_unfinished_requests():
            break
        engine.step()
        engine.check_invariants()
        if engine.last_step_idle:
            engine.clock.advance_to(engine.next_timer())
    assert not engine.has_unfinished_requests()
    kv = engine.scheduler.state.kv
    assert kv.num_held_blocks() == 0 and not kv.host_tables
    assert engine.scheduler.state.prefix_hit_tokens >= 8 * 192  # most agents find the system prompt cached


def test_evicted_cached_blocks_are_written_back_to_the_host_tier():
    """A finished request's cached blocks, evicted for another request, are copied to the host
    first (within the swap budget); a later request with that prefix loads them from there."""
    # Without agent retention a's blocks go straight to the prefix cache when it finishes.
    sched, ex = make("min-waste", device_blocks=10, host_blocks=20, agent_retention=False)
    a = Request("a", list(range(24)), SamplingParams(max_tokens=2), 0.0)
    sched.add_request(a)
    now = run_until_generated(sched, ex, a, 2, 0.0)
    assert a.is_finished and sched.state.kv.device.num_cached_free_blocks == 6
    big = Request("big", list(range(500, 538)), SamplingParams(max_tokens=2), now)
    sched.add_request(big)
    now += 0.01
    out, _ = step(sched, ex, now)
    assert len(out.blocks_to_back_up) == 6  # a's six cached blocks, evicted for big's ten
    while not big.is_finished:
        now += 0.01
        step(sched, ex, now)
    sched.state.kv.device.reset_prefix_cache()
    c = Request("c", list(range(24)) + [9], SamplingParams(max_tokens=3), now)
    sched.add_request(c)
    now += 0.01
    out, _ = step(sched, ex, now)
    assert c.num_cached_tokens == 24 and len(out.blocks_to_swap_in) == 6
    while not c.is_finished:
        now += 0.01
        step(sched, ex, now)  # the fake executor checks every KV slot c attends to
        assert sched.state.last_step_recompute_tokens == 0


def test_blocks_kept_for_an_overdue_resume_decay():
    """Once the expected resume has passed by x, the block is expected x later still: a held
    turn whose client never came back is evicted before one expected soon."""
    pool = BlockPool(3)
    blocks = pool.allocate(3)
    for i, blk in enumerate(blocks):
        pool.register(blk, 2000 + i, (i,))
    pool.now = 10.0
    pool.free([blocks[0]], [12.0])   # expected in 2 s
    pool.free([blocks[1]], [9.0])    # 1 s overdue: expected at 11
    pool.free([blocks[2]], [1.0])    # 9 s overdue: expected at 19
    assert [pool.allocate(1)[0].block_id for _ in range(3)] == [2, 0, 1]


def test_min_waste_releases_a_held_turn_once_it_is_long_overdue():
    from segue.sched.interception.base import PausedRequest, estimated_duration
    req = Request("a", [1], SamplingParams(), 0.0)
    assert estimated_duration(PausedRequest(req, 64, 0, elapsed_s=1.0, expected_s=3.0)) == 2.0
    assert estimated_duration(PausedRequest(req, 64, 0, elapsed_s=3.0, expected_s=3.0)) == 0.0
    assert estimated_duration(PausedRequest(req, 64, 0, elapsed_s=10.0, expected_s=3.0)) == 7.0
    # No host (preserve or discard); recompute costly enough that a wait under ~1 s is held.
    sched, ex = make("min-waste", host_blocks=0, fwd_ms_per_token=100.0)
    a = Request("a", list(range(22)), SamplingParams(max_tokens=8), 0.0)
    sched.add_request(a)
    now = run_until_generated(sched, ex, a, 3, 0.0)
    sched.intercept_request(a, now)
    sched.set_expected_resume("a", now + 0.5)
    held = []
    for _ in range(400):
        now += 0.01
        step(sched, ex, now)
        held.append(sched.state.kv.num_device_blocks_of("a"))
    # Held while expected back soon and just after; released once overdue by about as long.
    assert held[60] > 0 and held[-1] == 0 and held.index(0) > 100
