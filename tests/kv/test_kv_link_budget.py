"""One link budget per step (issue 26): every copy between the device and the host tier (swap-ins
of resumed requests and of host-tier prefix hits, swap-outs, write-backs of evicted cached
blocks) draws from the same per-step budget, what the link moves behind the step's compute. The
KV invariants are checked after every step (test_kv_tiers.step) and the fake executor checks
every KV slot a step reads."""
from __future__ import annotations

import random

from test_kv_tiers import BS, make, run_until_generated, step

from segue.request import Request, RequestStatus
from segue.sampling_params import SamplingParams


def link_blocks(sched) -> int:
    """The budget the next step's copies must stay within, in blocks."""
    return sched.state.cost.swap_limit(sched.state.last_batch_tokens) // BS


def copies(out) -> int:
    return len(out.blocks_to_swap_in) + len(out.blocks_to_swap_out) + len(out.blocks_to_back_up)


def checked_step(sched, ex, now: float):
    budget = link_blocks(sched)
    pays = sched.state.cost.copy_pays(sched.state.kv.write_back_reuse_rate(), BS)
    stalled_before = sched.state.kv.num_stalled_write_backs
    out, got = step(sched, ex, now)
    stalled = sched.state.kv.num_stalled_write_backs - stalled_before
    # Only write-backs may go past the budget, and only where saving a recompute pays for the
    # stall (CostModel.copy_pays).
    assert pays or not stalled
    # A swap-in always moves at least one block, so a request progresses on a link too slow
    # for a whole block per step.
    assert copies(out) - stalled <= max(budget, 1), (copies(out), stalled, budget)
    return out, got


def test_host_hit_swap_ins_and_write_backs_share_the_budget():
    """A host-tier hit's swap-ins allocate device blocks, which evicts cached blocks that get
    written back: both kinds of copy in one step, within one budget (before: each had a whole
    budget of its own, twice the link's capacity)."""
    # Without agent retention a's blocks go straight to the prefix cache when it finishes.
    sched, ex = make("min-waste", device_blocks=10, host_blocks=20, agent_retention=False)
    a = Request("a", list(range(24)), SamplingParams(max_tokens=2), 0.0)
    sched.add_request(a)
    now = run_until_generated(sched, ex, a, 2, 0.0)
    big = Request("big", list(range(500, 538)), SamplingParams(max_tokens=2), now)
    sched.add_request(big)
    while not big.is_finished:  # evicts a's blocks into the host tier (a fast link: all of them)
        now += 0.01
        step(sched, ex, now)
    assert sched.state.kv.device.num_cached_free_blocks >= 9 and sched.state.kv.host.num_cached_free_blocks >= 6
    # Now a slow link: three blocks a step behind a decode's compute.
    cost = sched.state.cost
    cost.swap_bytes_per_s = 3 * BS * cost.kv_bytes_per_token / cost.t_fwd(sched.state.last_batch_tokens)
    assert link_blocks(sched) == 3
    c = Request("c", list(range(24)) + [9], SamplingParams(max_tokens=3), now)
    sched.add_request(c)
    now += 0.01
    out, _ = checked_step(sched, ex, now)
    assert c.status is RequestStatus.SWAPPED and out.blocks_to_swap_in  # the host hit is loading
    # Swap-ins come first; write-backs get only what they leave.
    assert len(out.blocks_to_swap_in) == 3 and not out.blocks_to_back_up
    while not c.is_finished:
        now += 0.01
        checked_step(sched, ex, now)
        assert sched.state.last_step_recompute_tokens == 0


def test_write_backs_past_the_budget_only_where_the_recompute_they_save_pays_for_the_stall():
    """An evicted cached block is copied to the host even when the step's budget is spent, if
    its expected recompute (the tier's measured reuse rate) costs more than the copy's stall;
    on a link slower than recomputing, never."""
    for copy_over_recompute, expect_stalls in ((0.2, True), (3.0, False)):
        sched, ex = make("min-waste", device_blocks=10, host_blocks=40, agent_retention=False)
        cost = sched.state.cost
        # A copy of one block takes `copy_over_recompute` times its recompute.
        cost.swap_bytes_per_s = BS * cost.kv_bytes_per_token / (copy_over_recompute * cost.t_fwd_extra(BS))
        now = 0.0
        for i in range(4):  # each evicts the last one's cached blocks
            r = Request(f"r{i}", list(range(1000 * i, 1000 * i + 9 * BS)), SamplingParams(max_tokens=2), now)
            sched.add_request(r)
            while not r.is_finished:
                now += 0.01
                checked_step(sched, ex, now)
        assert (sched.state.kv.num_stalled_write_backs > 0) is expect_stalls
        if expect_stalls:
            # r0's written-back blocks are read back by its next turn: the measured reuse rate
            # (1/2 before any outcome) rises, and nothing is recomputed.
            assert sched.state.kv.write_back_reuse_rate() == 0.5
            again = Request("again", list(range(9 * BS)) + [7], SamplingParams(max_tokens=2), now)
            sched.add_request(again)
            while not again.is_finished:
                now += 0.01
                checked_step(sched, ex, now)
                assert sched.state.last_step_recompute_tokens == 0
            assert again.num_cached_tokens == 9 * BS
            assert sched.state.kv.write_back_reuse_rate() > 0.8


def test_no_step_copies_more_than_the_link_budget_under_load():
    """Agents that share a prompt prefix, pause for tools and come back, on a small pool with a
    host tier and a link that moves a few blocks a step: swap-ins, swap-outs, host hits and
    write-backs all happen, and no step copies more than the budget but the write-backs that pay
    for their stall."""
    rng = random.Random(3)
    sched, ex = make("min-waste", device_blocks=24, host_blocks=48, budget=32)
    cost = sched.state.cost
    cost.swap_bytes_per_s = 4 * BS * cost.kv_bytes_per_token / cost.t_fwd(1)  # ~4 blocks a step
    prefix = list(range(200, 220))
    reqs, now, kinds = [], 0.0, set()
    for i in range(12):
        r = Request(f"r{i}", prefix + [rng.randrange(1, 50) for _ in range(rng.randint(2, 14))],
                    SamplingParams(max_tokens=rng.randint(4, 12)), now)
        sched.add_request(r)
        reqs.append(r)
    for _ in range(3000):
        if all(r.is_finished for r in reqs):
            break
        now += 0.01
        out, got = checked_step(sched, ex, now)
        kinds.update(k for k in ("blocks_to_swap_in", "blocks_to_swap_out", "blocks_to_back_up") if getattr(out, k))
        for r in (u.request for u in got):
            if not r.is_finished and r.status is RequestStatus.RUNNING and rng.random() < 0.15:
                sched.intercept_request(r, now)
        for r in list(sched.state.paused.paused.values()):
            if rng.random() < 0.2:
                sched.resume_request(r, [rng.randrange(1, 50)], now)
    assert all(r.is_finished for r in reqs)
    assert kinds == {"blocks_to_swap_in", "blocks_to_swap_out", "blocks_to_back_up"}


def test_a_swap_out_that_copies_nothing_still_makes_the_request_swapped():
    """A request swapped back in finds its host copies still cached in the host tier, so swapping
    it out again moves its blocks without a copy: it must still leave the waiting queue (before:
    it waited with its context on the host, and a later step ran it on a partial context)."""
    from segue.sched.memory import swap_out
    from segue.sched.output import SchedulerOutput
    sched, ex = make("preserve", device_blocks=10, host_blocks=20)
    kv = sched.state.kv
    a = Request("a", list(range(16)), SamplingParams(max_tokens=8), 0.0)
    sched.add_request(a)
    assert kv.allocate_slots(a, 16)
    a.num_computed_tokens = 16
    kv.cache_full_blocks(a)
    kv.swap_out(a, 4)
    kv.release_swapped_out()           # the host copies are published
    kv.swap_in(a, 4)                   # (the device cache still held them: shared, not copied)
    kv.release_swapped_out()           # back on the device; the host tier keeps them cached
    assert kv.num_host_blocks_of("a") == 0 and kv.host.num_cached_free_blocks == 4
    out = SchedulerOutput()
    assert swap_out(sched.state, a, 4, out) == 4 and out.blocks_to_swap_out == []
    assert a.status is RequestStatus.SWAPPED and a in sched.state.paused.swapped and a not in sched.state.waiting
    sched.check_invariants()


def test_nothing_running_waits_for_swap_outs_in_flight_before_discarding_a_holder() -> None:
    """free_for_idle_step (nothing runs, the head does not fit): blocks a swap-out is copying to
    the host are free by the next step, so while they cover the head's need no waiting request's
    resident context is thrown away (it would be recomputed)."""
    from segue.sched.memory import free_for_idle_step
    sched, _ = make("preserve", device_blocks=10, host_blocks=20)
    kv = sched.state.kv
    paused = Request("paused", list(range(300, 316)), SamplingParams(max_tokens=4), 0.0)
    assert kv.allocate_slots(paused, 16)
    paused.num_computed_tokens = 16
    kv.open_link(64)
    assert len(kv.swap_out(paused, 4).copies) == 4 and kv.num_swapping_out_blocks == 4
    holder = Request("holder", list(range(400, 416)), SamplingParams(max_tokens=4), 0.0)
    sched.add_request(holder)
    assert kv.allocate_slots(holder, 16)
    holder.num_computed_tokens = 16
    head = Request("head", list(range(500, 528)), SamplingParams(max_tokens=4), 0.0)
    assert kv.num_free_blocks == 2
    assert not free_for_idle_step(sched.state, head, 6)  # 2 free + 4 in flight: wait a step
    assert kv.num_device_blocks_of("holder") == 4 and holder.num_preemptions == 0
    assert free_for_idle_step(sched.state, head, 7)  # more than will come free: the holder gives way
    assert kv.num_device_blocks_of("holder") == 0 and holder.num_preemptions == 1
