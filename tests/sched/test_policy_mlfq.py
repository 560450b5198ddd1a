"""Skip-join MLFQ (FastServe §4.1) and its KV management (§4.2) on the pure scheduler: placement,
demotion, promotion, overtaking, a starvation bound, ENST-ordered eviction and the arrival
reserve, with KV invariants checked after every step."""
from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fake_executor import VOCAB, FakeKVExecutor, PlannedPauses, expected_output
from segue.config import SchedulerConfig
from segue.kv.manager import KVCacheManager
from segue.request import Request, RequestStatus
from segue.sampling_params import SamplingParams
from segue.sched.cost_model import CostModel
from segue.sched.interception import make_interception_policy
from segue.sched.policies import PolicyContext, make_policy
from segue.sched.policies.mlfq import MLFQPolicy
from segue.sched.request_queue import RequestQueue
from segue.sched.scheduler import Scheduler

BS = 4
# T_fwd(t) = (t + 9) ms: a decode step takes 10 ms, the base quantum; quanta 10, 20, 40, 80, ... ms.
COST = CostModel(fwd_ms_per_token=1.0, fwd_base_ms=9.0)
NO_RESERVE = {"reserve_window_s": 0.0}


def make(num_blocks=64, host_blocks=0, budget=64, max_seqs=4, cost=COST, interception="preserve",
         **options) -> tuple[Scheduler, MLFQPolicy]:
    ctx = PolicyContext(cost=cost, kv_capacity_tokens=num_blocks * BS, block_size=BS,
                        options={**NO_RESERVE, **options})
    policy = make_policy("mlfq", ctx)
    kv = KVCacheManager(BS, num_blocks, host_blocks)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_seqs), kv, policy,
                      max_model_len=num_blocks * BS, interception=make_interception_policy(interception),
                      cost=cost)
    return sched, policy


def req(rid: str, prompt: int, max_tokens: int, t: float = 0.0, first_token: int = 1) -> Request:
    tokens = [first_token + i % 7 for i in range(prompt)]
    return Request(rid, tokens, SamplingParams(max_tokens=max_tokens, ignore_eos=True), t)


def step(sched: Scheduler, now: float):
    """One step on a fake model; the clock advances by the step's T_fwd. Returns (out, new now)."""
    out = sched.schedule(now)
    sched.update_from_output(out, {s.request.request_id: 3 for s in out.seqs if s.sample})
    sched.check_invariants()
    return out, now + sched.state.cost.t_fwd(out.num_batched_tokens)


def test_skip_join_places_by_prefill_time():
    sched, policy = make()
    # Prefill times 10, 20, 39 and 109 ms against quanta 10, 20, 40, 80, 160 ms.
    for rid, prompt in [("a", 1), ("b", 11), ("c", 30), ("d", 100), ("e", 1)]:
        sched.add_request(req(rid, prompt, 4))
    assert {rid: e.level for rid, e in policy.entries.items()} == {"a": 0, "b": 1, "c": 2, "d": 4, "e": 0}
    order = sorted(sched.state.waiting, key=lambda r: policy.key(r, 0.0))
    assert [r.request_id for r in order] == ["a", "e", "b", "c", "d"]  # FCFS within a queue
    plain, plain_policy = make(skip_join=False)
    for rid, prompt in [("a", 1), ("d", 100)]:
        plain.add_request(req(rid, prompt, 4))
    assert {e.level for e in plain_policy.entries.values()} == {0}


def test_demotion_after_each_quantum():
    """A lone decoder spends 1, 2, 4, 8 steps of 10 ms in queues 0, 1, 2, 3."""
    sched, policy = make()
    r = req("r", 1, 40)
    sched.add_request(r)
    now, levels = 0.0, []
    for _ in range(20):
        _, now = step(sched, now)
        levels.append(policy.entries["r"].level)
    expected = [(k + 1).bit_length() - 1 for k in range(1, 21)]  # floor(log2(k + 1))
    assert levels == expected


def test_demotion_skips_to_a_queue_that_fits_the_next_iteration():
    """Original MLFQ placement (all arrivals at q_0) with a chunked 200-token prompt: after the
    first 8-token chunk uses up q_0, the rest of the prefill (201 ms) needs the 320 ms queue."""
    sched, policy = make(budget=8, skip_join=False)
    sched.add_request(req("r", 200, 2))
    step(sched, 0.0)
    assert policy.entries["r"].level == 5


def test_promotion_after_starvation():
    sched, policy = make(max_seqs=1, starvation_limit_s=0.1)
    long = req("long", 1, 100)
    sched.add_request(long)
    now = 0.0
    for _ in range(7):
        _, now = step(sched, now)
    assert policy.entries["long"].level == 3
    served_at, promoted_at = [], None
    for i in range(40):
        sched.add_request(req(f"s{i}", 1, 1, now))  # one single-step request per step
        out, next_now = step(sched, now)
        if promoted_at is None and policy.entries["long"].level == 0:
            promoted_at = now
        if any(s.request is long for s in out.seqs):
            served_at.append(now)
        now = next_now
    assert promoted_at is not None
    starved_since = 7 * 0.010
    assert promoted_at - starved_since == pytest.approx(0.1, abs=0.011)
    # Promoted behind the one short request already queued, then served.
    assert served_at and served_at[0] - promoted_at <= 0.0201
    assert long.num_preemptions == 0  # it kept its KV while it waited


@pytest.mark.parametrize("policy_name", ["mlfq", "fcfs"])
def test_short_request_overtakes_a_long_one(policy_name):
    sched, _ = make(max_seqs=1)
    if policy_name == "fcfs":
        sched.state.policy = make_policy("fcfs")
    long, short = req("long", 1, 50), req("short", 1, 3)
    sched.add_request(long)
    now, finished = 0.0, []
    for i in range(60):
        if i == 10:
            sched.add_request(short)
        _, now = step(sched, now)
        finished += [r.request_id for r in (long, short) if r.is_finished and r.request_id not in finished]
    assert set(finished) == {"long", "short"}
    if policy_name == "mlfq":
        assert finished == ["short", "long"]
        assert long.num_preemptions == 0 and sched.state.num_preemptions_total == 0
    else:
        assert finished == ["long", "short"]


@pytest.mark.parametrize("limit_s, finishes", [(0.1, True), (1e9, False)])
def test_long_request_survives_an_adversarial_stream(limit_s, finishes):
    """The adversary keeps a fresh single-step request ready in the top queue at every step, and
    there is one sequence slot. With a starvation limit the long request still gets a token per
    promotion: it finishes within max_tokens * (limit + 3 steps) of virtual time. Without one it
    never runs again."""
    sched, _ = make(max_seqs=1, starvation_limit_s=limit_s)
    long = req("long", 1, 30)
    sched.add_request(long)
    now, i = 0.0, 0
    bound = 30 * (0.1 + 3 * 0.010)
    while now < bound + 0.5 and not long.is_finished:
        if not any(r is not long for r in sched.state.waiting):
            sched.add_request(req(f"s{i}", 1, 1, now))
            i += 1
        _, now = step(sched, now)
    if finishes:
        assert long.is_finished and now <= bound
    else:
        assert not long.is_finished and long.num_generated_tokens < 30


def place(policy: MLFQPolicy, request_id: str, level: int, last_served: float | None = None) -> None:
    """Hand-place a request in a queue for a test's setup, keeping its ticket (its FIFO place)."""
    entry = policy.entries[request_id]
    policy._tally(entry, -1)
    del policy._queues[entry.level][request_id]
    entry.level = level
    queue = policy._queues[level]
    ordered = sorted([*queue, request_id], key=lambda rid: policy.entries[rid].ticket)
    queue.clear()
    queue.update(dict.fromkeys(ordered))
    policy._tally(entry, +1)
    if last_served is not None:
        policy._mark_served(entry, last_served)


def test_enst_prefers_the_request_about_to_be_promoted():
    """ENST = min(T_promote, T_execute): a request deep in the queues whose promotion is due
    soon is expected to run before one in a higher queue, so it keeps its memory."""
    sched, policy = make(base_quantum_s=1.0, starvation_limit_s=10.0)
    x, y, z = req("x", 1, 8), req("y", 1, 8), req("z", 1, 8)
    for r in (x, y, z):
        sched.add_request(r)
    now = 100.0
    place(policy, "y", 2, last_served=now)
    place(policy, "z", 3, last_served=now - 9.99)
    policy.on_step(now)
    enst = policy.enst([x, y, z], now)
    assert enst["x"] == 0.0  # nothing above the top queue
    assert enst["y"] == pytest.approx(1.0 + 2.0)  # x runs down through q_0 and q_1 first
    assert enst["z"] == pytest.approx(0.01)  # promoted in 10 ms
    assert [r.request_id for r in policy.preemption_order([x, y, z], now)] == ["y", "z", "x"]


def test_memory_pressure_without_a_host_pool_makes_the_head_wait():
    """Nothing is dropped to recompute (under overload that restarts requests over and over):
    without host room the higher-priority arrival waits for memory, as in vLLM, while lower ones
    that already hold their KV keep running within the free blocks (that is how memory comes back)."""
    sched, policy = make(num_blocks=14, max_seqs=3, base_quantum_s=1.0, starvation_limit_s=10.0)
    x, y, z = req("x", 12, 8), req("y", 12, 8), req("z", 12, 8)
    for r in (x, y, z):
        sched.add_request(r)
    _, now = step(sched, 0.0)  # all three prefill: 9 of 14 blocks held
    assert sched.state.kv.num_free_blocks == 5
    place(policy, "y", 2)
    place(policy, "z", 3)
    sched.state.config.max_num_seqs = 2
    n = req("n", 20, 2, now, first_token=20)  # 5 blocks (no prefix hit), joins q_0 behind x
    sched.add_request(n)
    out, now = step(sched, now)
    assert [s.request.request_id for s in out.seqs] == ["x", "y"]  # n waits; z is past max_num_seqs
    assert not out.preempted and not out.blocks_to_swap_out
    assert sched.state.kv.num_device_blocks_of("z") == 3 and sched.state.kv.num_device_blocks_of("y") >= 3
    while not x.is_finished:  # x finishes and frees its blocks; then n runs
        out, now = step(sched, now)
    out, now = step(sched, now)
    assert "n" in [s.request.request_id for s in out.seqs] and sched.state.num_preemptions_total == 0


def test_a_holder_that_cannot_grow_takes_blocks_from_lower_holders():
    """Host full (here: none): behind a blocked head, requests that hold KV but need one more block
    discard the lowest-ranked holder instead of idling while only holders with room in their last
    block run (which kept the discard fallback for the head from ever firing)."""
    sched, policy = make(num_blocks=16, max_seqs=4, base_quantum_s=1.0, starvation_limit_s=10.0)
    x, y, z = req("x", 16, 8), req("y", 16, 8, first_token=2), req("z", 16, 8, first_token=3)
    w = req("w", 13, 8, first_token=4)  # 13 tokens in 4 blocks: room for 3 more without a block
    for r in (x, y, z, w):
        sched.add_request(r)
    _, now = step(sched, 0.0)
    assert sched.state.kv.num_free_blocks == 0
    for rid, level in (("x", 0), ("y", 1), ("z", 3), ("w", 4)):
        place(policy, rid, level)
    out, now = step(sched, now)
    # x, the head, waits for memory; y and z grow into w's blocks; w recomputes later.
    assert [s.request.request_id for s in out.seqs] == ["y", "z"]
    assert sched.state.kv.num_device_blocks_of("w") == 0 and w.num_computed_tokens == 0
    assert sched.state.num_preemptions_total == 1
    out, now = step(sched, now)
    assert "x" in [s.request.request_id for s in out.seqs]


def test_memory_pressure_swaps_out_the_largest_enst_holder():
    """The largest-ENST holder is swapped out (nothing to recompute); the head waits one step for
    the copies, then gets the memory before any swap-in or a resident's growth can take it."""
    sched, policy = make(num_blocks=14, host_blocks=16, max_seqs=3, base_quantum_s=1.0,
                         starvation_limit_s=10.0)
    x, y, z = req("x", 12, 8), req("y", 12, 8), req("z", 12, 8)
    for r in (x, y, z):
        sched.add_request(r)
    _, now = step(sched, 0.0)
    place(policy, "y", 2)
    place(policy, "z", 3, last_served=now - 9.99)
    sched.state.config.max_num_seqs = 2
    n = req("n", 20, 2, now, first_token=20)
    sched.add_request(n)
    out, now = step(sched, now)
    # n waits for the swap-out; z, which holds its KV, runs within the free blocks meanwhile.
    assert [s.request.request_id for s in out.seqs] == ["x", "z"]
    # n needs 5 blocks and 4 are free: y goes to the host, whole (half of it could not run).
    assert not out.preempted and len(out.blocks_to_swap_out) == 3
    assert y.status == RequestStatus.SWAPPED and sched.state.kv.num_host_blocks_of("y") == 3
    assert sched.state.kv.num_device_blocks_of("y") == 0
    # Key order would pick z (the lowest queue); ENST picks y, which z will overtake by promotion.
    assert sched.state.kv.num_device_blocks_of("z") == 4  # its 3, and one for the token it computed
    out, now = step(sched, now)
    assert [s.request.request_id for s in out.seqs] == ["x", "n"] and not out.blocks_to_swap_in
    assert y.num_preemptions == 0 and y.num_computed_tokens == 12  # nothing to recompute


def test_reserve_swaps_out_pending_requests_and_brings_them_back():
    """Arrivals set a reserve; pending requests (not served this step) are swapped out to keep
    it free, within the step's swap budget, and come back when memory frees up."""
    cost = CostModel(fwd_ms_per_token=1.0, fwd_base_ms=9.0, swap_bytes_per_s=1e9, kv_bytes_per_token=100)
    # The four prompts (40 tokens) arrive inside the window: the reserve is 8 of the 16 blocks,
    # while the four requests grow to 4 blocks each.
    sched, policy = make(num_blocks=16, host_blocks=32, max_seqs=1, cost=cost, reserve_window_s=10.0,
                         max_reserve_fraction=0.5)
    ex = FakeKVExecutor(BS)
    reqs = [req(f"r{i}", 10, 6, first_token=10 * i) for i in range(4)]
    now, saw_swap_out, min_slack = 0.0, False, None
    for r in reqs:
        sched.add_request(r)
    for _ in range(200):
        if not sched.has_unfinished_requests():
            break
        out = sched.schedule(now)
        saw_swap_out |= bool(out.blocks_to_swap_out)
        reserve = policy.reserved_blocks(now)
        sched.update_from_output(out, ex.execute(out))
        sched.check_invariants()
        now += cost.t_fwd(out.num_batched_tokens)
        if out.blocks_to_swap_out:
            slack = sched.state.kv.num_free_blocks + len(out.blocks_to_swap_out) - reserve
            min_slack = slack if min_slack is None else min(min_slack, slack)
    assert not sched.has_unfinished_requests()
    assert saw_swap_out and min_slack is not None and min_slack >= 0
    assert sched.state.kv.num_held_blocks() == 0 and not sched.state.kv.host_tables
    for r in reqs:
        assert r.output_token_ids == expected_output(r.prompt_token_ids, 6, set())


def _assert_enst_sums_current(policy: MLFQPolicy) -> None:
    """The per-queue sums the hooks keep for ENST equal a recount over every entry."""
    count, standing = [0] * len(policy.quanta), [0.0] * len(policy.quanta)
    for e in policy.entries.values():
        if not e.paused:
            count[e.level] += 1
            standing[e.level] += policy._prefix[e.level] + e.attained_s
    assert policy._count == count
    assert policy._standing == pytest.approx(standing, abs=1e-9)


def _assert_queue_order_current(policy: MLFQPolicy, requests: list[Request], now: float) -> None:
    """The per-queue ticket lists hold every entry once, in its queue and in ticket order, so
    walking them (`sort`) gives the key order."""
    for level, queue in enumerate(policy._queues):
        tickets = [policy.entries[rid].ticket for rid in queue]
        assert tickets == sorted(tickets)
        assert all(policy.entries[rid].level == level for rid in queue)
    assert sum(len(q) for q in policy._queues) == len(policy.entries)
    walked = list(policy.order(RequestQueue(requests), now))
    assert walked == sorted(requests, key=lambda r: policy.key(r, now))


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), num_blocks=st.integers(12, 40), host_blocks=st.integers(0, 40),
       interception=st.sampled_from(["preserve", "discard", "swap", "min-waste"]),
       reserve_window_s=st.sampled_from([0.0, 0.02, 1.0]))
def test_random_mlfq_runs_keep_kv_correct(seed, num_blocks, host_blocks, interception, reserve_window_s):
    """Random arrivals, pauses and resumes under mlfq with small pools: every KV read is checked
    for content, invariants hold after every step, and everything finishes with the right tokens."""
    rng = random.Random(seed)
    cost = CostModel(fwd_ms_per_token=1.0, fwd_base_ms=5.0, saturation_tokens=16,
                     swap_bytes_per_s=rng.choice([1e3, 1e5, 1e9]), kv_bytes_per_token=100)
    sched, _ = make(num_blocks=num_blocks, host_blocks=host_blocks, budget=rng.randrange(4, 40),
                    max_seqs=rng.randrange(1, 6), cost=cost, interception=interception,
                    starvation_limit_s=rng.choice([0.02, 0.2, 5.0]), reserve_window_s=reserve_window_s)
    sched.state.max_model_len = num_blocks * BS // 2
    ex = FakeKVExecutor(BS)
    arrivals, pauses = [], PlannedPauses(rng)
    for i in range(rng.randrange(1, 10)):
        prompt = [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 16))]
        max_tokens = rng.randrange(2, 10)
        if len(prompt) + max_tokens + 6 > sched.state.max_model_len:
            continue
        r = Request(f"r{i}", prompt, SamplingParams(max_tokens=max_tokens), 0.0)
        pauses.plans[r.request_id] = pauses.draw(max_tokens)
        arrivals.append((rng.choice([0.0, 0.0, 0.05, 0.3]), r))
    arrivals.sort(key=lambda a: a[0])
    reqs = [r for _, r in arrivals]
    now = 0.0
    for _ in range(5000):
        if not arrivals and not sched.has_unfinished_requests():
            break
        now += 0.01
        while arrivals and arrivals[0][0] <= now:
            sched.add_request(arrivals.pop(0)[1])
        pauses.resume_due(sched, now)
        out = sched.schedule(now)
        # Starvation prevention promoted everyone due (found through its service-time heap).
        limit = sched.state.policy.options.starvation_limit_s
        assert all(now - e.last_served < limit - 1e-9 for e in sched.state.policy.entries.values()
                   if e.level > 0 and not e.paused)
        got = sched.update_from_output(out, ex.execute(out))
        pauses.pause_planned(sched, (u.request for u in got), now, expected_s=(None, 0.05))
        sched.check_invariants()
        _assert_enst_sums_current(sched.state.policy)
        _assert_queue_order_current(sched.state.policy, list(sched.state.requests.values()), now)
    assert not sched.has_unfinished_requests(), "requests left unfinished"
    assert sched.state.kv.num_held_blocks() == 0 and not sched.state.kv.host_tables
    assert sched.state.policy._count == [0] * len(sched.state.policy.quanta)
    for r in reqs:
        assert r.status == RequestStatus.FINISHED_LENGTH
        assert r.output_token_ids == pauses.expected(r)


@pytest.mark.parametrize("share, expect", [(0.5, {"n": 14, "x": 1, "y": 1}), (0.0, {"n": 16})])
def test_prefill_chunk_leaves_room_for_resident_decodes(share: float, expect: dict[str, int]) -> None:
    """A top-queue prompt's chunk is trimmed so demoted requests that hold KV still decode (one
    token each); with decode_share 0 every token goes by strict priority."""
    sched, policy = make(budget=16, decode_share=share, starvation_limit_s=10.0)
    x, y = req("x", 4, 8), req("y", 4, 8)
    for r in (x, y):
        sched.add_request(r)
    _, now = step(sched, 0.0)
    place(policy, "x", 5)
    place(policy, "y", 5)
    sched.add_request(req("n", 40, 2, now, first_token=20))
    out, now = step(sched, now)
    assert {s.request.request_id: s.num_tokens for s in out.seqs} == expect
