"""Randomized scheduler + KV manager runs with invariants checked after every step."""
from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from segue.config import SchedulerConfig
from segue.kv.manager import KVCacheManager
from segue.request import Request, RequestStatus
from segue.sampling_params import SamplingParams
from segue.sched.policies import make_policy
from segue.sched.scheduler import Scheduler

VOCAB = 50


def make_scheduler(num_blocks=32, block_size=4, budget=32, max_seqs=8, caching=True, watermark=0.0,
                   agent_retention=True):
    kv = KVCacheManager(block_size, num_blocks, enable_prefix_caching=caching)
    cfg = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_seqs, watermark=watermark,
                          agent_retention=agent_retention)
    return Scheduler(cfg, kv, make_policy("fcfs"), max_model_len=num_blocks * block_size)


def fake_token(req: Request) -> int:
    # Deterministic "model": next token depends on the context, like a real one.
    return (sum(req.all_token_ids) * 31 + req.num_tokens) % VOCAB


def run_step(sched: Scheduler, now: float) -> None:
    out = sched.schedule(now)
    sampled = {s.request.request_id: fake_token(s.request) for s in out.seqs if s.sample}
    for s in out.seqs:
        assert s.num_tokens >= 1
        assert len(s.block_table) * sched.state.kv.block_size >= s.start_pos + s.num_tokens
    assert out.num_batched_tokens <= sched.state.config.max_num_batched_tokens
    assert len(out.seqs) <= sched.state.config.max_num_seqs
    sched.update_from_output(out, sampled)
    sched.check_invariants()


def expire_retained(sched: Scheduler) -> None:
    """Step once after every retained history has expired (sched/agents.py keeps a finished
    request's context while its agent is likely back): then the pool must be whole again."""
    sched.schedule(sched.state.now + 1e6)
    sched.check_invariants()


def reference_output(prompt: list[int], max_tokens: int) -> list[int]:
    req = Request("ref", list(prompt), SamplingParams(max_tokens=max_tokens), 0.0)
    for _ in range(max_tokens):
        req.output_token_ids.append(fake_token(req))
    return req.output_token_ids


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10_000), num_blocks=st.integers(8, 40), budget=st.integers(1, 40),
       caching=st.booleans())
def test_random_workload_invariants_and_outputs(seed, num_blocks, budget, caching):
    rng = random.Random(seed)
    sched = make_scheduler(num_blocks=num_blocks, budget=budget, caching=caching)
    shared = [rng.randrange(VOCAB) for _ in range(rng.randrange(0, 12))]
    reqs, aborted = [], set()
    for i in range(rng.randrange(1, 12)):
        prompt = (shared if rng.random() < 0.5 else []) + [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 14))]
        max_tokens = rng.randrange(1, 10)
        if len(prompt) + max_tokens > sched.state.max_model_len:
            continue
        reqs.append(Request(f"r{i}", prompt, SamplingParams(max_tokens=max_tokens), float(i)))
    pending = list(reqs)
    step = 0
    while pending or sched.has_unfinished_requests():
        if pending and rng.random() < 0.5:
            sched.add_request(pending.pop(0))
        if sched.state.requests and rng.random() < 0.05:
            rid = rng.choice(sorted(sched.state.requests))
            sched.abort_request(rid)
            aborted.add(rid)
            sched.check_invariants()
        run_step(sched, float(step))
        step += 1
        assert step < 5000, "scheduler made no progress"
    expire_retained(sched)
    assert sched.state.kv.num_held_blocks() == 0
    assert sched.state.kv.device.num_free_blocks == num_blocks
    for req in reqs:
        if req.request_id in aborted:
            assert req.status == RequestStatus.FINISHED_ABORTED
            continue
        assert req.status == RequestStatus.FINISHED_LENGTH
        # Preemption, chunking and prefix hits must not change what is generated.
        assert req.output_token_ids == reference_output(req.prompt_token_ids, req.sampling_params.max_tokens)


def test_prefix_cache_hit_counts_whole_blocks_and_backs_off_full_hit():
    sched = make_scheduler(num_blocks=16, block_size=4, budget=64)
    prompt = list(range(10))
    a = Request("a", prompt, SamplingParams(max_tokens=1), 0.0)
    sched.add_request(a)
    run_step(sched, 0.0)
    assert a.is_finished
    b = Request("b", prompt + [11], SamplingParams(max_tokens=1), 1.0)
    sched.add_request(b)
    out = sched.schedule(1.0)
    assert b.num_cached_tokens == 8  # two full blocks of four
    assert out.seqs[0].start_pos == 8 and out.seqs[0].token_ids == [8, 9, 11]
    sched.update_from_output(out, {"b": 0})
    c = Request("c", list(range(8)), SamplingParams(max_tokens=1), 2.0)
    sched.add_request(c)
    out = sched.schedule(2.0)
    # Everything is cached, but the last token must run to produce logits.
    assert c.num_cached_tokens == 4 and out.seqs[0].token_ids == [4, 5, 6, 7]
    sched.update_from_output(out, {"c": 0})
    sched.check_invariants()


def test_preemption_when_blocks_run_out_recomputes_latest_arrival():
    # The preemption mechanism itself: with thrashing avoidance (the default) b would not start
    # in a pool it cannot finish in (tests/sched/test_agent_retention.py).
    sched = make_scheduler(num_blocks=4, block_size=4, budget=64, agent_retention=False)
    a = Request("a", list(range(7)), SamplingParams(max_tokens=6), 0.0)
    b = Request("b", list(range(20, 27)), SamplingParams(max_tokens=6), 1.0)
    sched.add_request(a)
    sched.add_request(b)
    preempted = []
    while sched.has_unfinished_requests():
        out = sched.schedule(0.0)
        preempted += [r.request_id for r in out.preempted]
        sched.update_from_output(out, {s.request.request_id: 1 for s in out.seqs if s.sample})
        sched.check_invariants()
    assert preempted and set(preempted) == {"b"}
    assert b.num_preemptions >= 1 and b.num_output_tokens == 6


def test_cache_salt_isolates_prefix_cache_between_tenants():
    sched = make_scheduler(num_blocks=16, block_size=4, budget=64)
    prompt = list(range(12))
    a = Request("a", prompt, SamplingParams(max_tokens=1), 0.0, cache_salt="tenant-1")
    sched.add_request(a)
    run_step(sched, 0.0)
    other = Request("b", prompt, SamplingParams(max_tokens=1), 1.0, cache_salt="tenant-2")
    same = Request("c", prompt, SamplingParams(max_tokens=1), 2.0, cache_salt="tenant-1")
    sched.add_request(other)
    sched.add_request(same)
    run_step(sched, 1.0)
    assert other.num_cached_tokens == 0 and same.num_cached_tokens == 8


def test_watermark_keeps_headroom_for_running_requests():
    """With a watermark, a new request is admitted only if the running ones keep that many free
    blocks to grow into; alone, it is admitted whatever the watermark (it could never run otherwise)."""
    for watermark, admitted in ((0.0, True), (0.25, False)):
        sched = make_scheduler(num_blocks=16, budget=64, watermark=watermark)
        sched.add_request(Request("x", list(range(1, 25)), SamplingParams(max_tokens=20), 0.0))
        run_step(sched, 0.0)  # x holds 6 blocks (24 tokens + the next)
        sched.add_request(Request("y", list(range(2, 30)), SamplingParams(max_tokens=4), 0.0))
        run_step(sched, 1.0)  # x grows to 7 blocks; y needs 7 of the 9 free: 2 left, under a 4-block mark
        assert (sched.state.requests["y"].status == RequestStatus.RUNNING) is admitted
    alone = make_scheduler(num_blocks=16, budget=64, watermark=0.5)
    alone.add_request(Request("z", list(range(1, 50)), SamplingParams(max_tokens=4), 0.0))
    run_step(alone, 0.0)
    assert alone.state.requests["z"].status == RequestStatus.RUNNING


def _capacity_scheduler(cap: int) -> Scheduler:
    kv = KVCacheManager(4, 64, enable_prefix_caching=False)
    cfg = SchedulerConfig(max_num_batched_tokens=256, max_num_seqs=8, latency_capacity_tokens=cap)
    return Scheduler(cfg, kv, make_policy("fcfs"), max_model_len=200)


def _add(sched: Scheduler, rid: str, prompt_len: int, latency_sensitive: bool) -> Request:
    req = Request(rid, [1] * prompt_len, SamplingParams(max_tokens=4), 0.0, latency_sensitive=latency_sensitive)
    sched.add_request(req)
    return req


def test_latency_capacity_caps_latency_sensitive_batches_and_not_task_groups():
    """Parrot's capacity: plain (latency-sensitive) requests share a batch of at most the capacity's
    tokens; a throughput task group alone fills the pool; a latency-sensitive arrival waits
    behind a throughput batch that is over the capacity, and a lone request always runs."""
    sched = _capacity_scheduler(40)
    for i in range(3):
        _add(sched, f"chat{i}", 16, True)
    out = sched.schedule(0.0)
    assert [s.request.request_id for s in out.seqs] == ["chat0", "chat1"]  # 32 tokens; a third makes 48

    sched = _capacity_scheduler(40)
    for i in range(3):
        _add(sched, f"map{i}", 16, False)
    out = sched.schedule(0.0)
    assert len(out.seqs) == 3
    sched.update_from_output(out, {s.request.request_id: 2 for s in out.seqs})
    _add(sched, "chat", 4, True)
    out = sched.schedule(0.1)
    assert "chat" not in {s.request.request_id for s in out.seqs}
    sched.check_invariants()

    sched = _capacity_scheduler(8)
    _add(sched, "long", 30, True)
    assert [s.request.request_id for s in sched.schedule(0.0).seqs] == ["long"]


# ---- the admission object ------------------------------------------------------------------

def _admission(sched: Scheduler, budget: int):
    from segue.sched.admission import Admission
    from segue.sched.output import SchedulerOutput

    return Admission(sched.state, SchedulerOutput(), budget, [])


def _waiting(sched: Scheduler, rid: str, prompt_len: int) -> Request:
    req = Request(rid, [hash((rid, i)) % VOCAB for i in range(prompt_len)], SamplingParams(max_tokens=4), 0.0)
    sched.add_request(req)
    return req


def test_admission_answers_each_candidate_with_an_enum():
    from segue.sched.admission import AddResult

    sched = make_scheduler(num_blocks=8, block_size=4, budget=32, max_seqs=2)
    a, b, c = (_waiting(sched, r, n) for r, n in (("a", 12), ("b", 8), ("c", 4)))
    adm = _admission(sched, 16)
    assert adm.add(a) is AddResult.ADMITTED and adm.budget == 4
    assert adm.add(b) is AddResult.ADMITTED and adm.budget == 0  # a chunk of 4 of its 8 tokens
    assert adm.add(c) is AddResult.NO_TOKEN and AddResult.NO_TOKEN.stops
    assert [(r.request_id, n) for r, n in adm.scheduled] == [("a", 12), ("b", 4)]
    assert adm.finish() == 0
    sched.check_invariants()


def test_non_preemptive_head_without_memory_stops_admission():
    from segue.sched.admission import AddResult

    sched = make_scheduler(num_blocks=4, block_size=4, budget=64)
    big, small = _waiting(sched, "big", 20), _waiting(sched, "small", 4)  # 5 blocks > the pool of 4
    adm = _admission(sched, 64)
    assert adm.add(big) is AddResult.NO_MEMORY and adm.blocked is not None
    assert not adm.scheduled and sched.state.kv.num_free_blocks == 4  # nothing taken on the way
    assert small.status == RequestStatus.WAITING
    sched.check_invariants()


def test_preemptive_admission_skips_past_a_blocked_head_to_holders():
    from segue.sched.admission import AddResult

    kv = KVCacheManager(4, 6)
    cfg = SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8)
    sched = Scheduler(cfg, kv, make_policy("mlfq"), max_model_len=32)
    big, other = _waiting(sched, "big", 24), _waiting(sched, "other", 4)
    assert kv.allocate_slots(other, 4)  # a waiting holder: its KV is resident, 5 blocks stay free
    adm = _admission(sched, 64)
    # No host tier to swap to and no paused context to release: the head waits, unblocking nothing.
    assert adm.add(big) is AddResult.SKIPPED and adm.blocked.request is big
    assert list(adm.candidates()) == [other]  # behind a blocked head only holders are read
    assert adm.add(other) is AddResult.ADMITTED  # it holds KV, so it runs behind the blocked head
    assert adm.finish() == 64 - 4
    sched.check_invariants()


def test_watermark_is_an_explicit_block_budget():
    sched = make_scheduler(num_blocks=10, block_size=4, watermark=0.2)
    a, b = _waiting(sched, "a", 4), _waiting(sched, "b", 4)
    adm = _admission(sched, 32)
    assert adm.watermark_blocks == 2
    assert adm.headroom(a) == 0  # nothing runs yet: the first request needs no headroom
    adm.add(a)
    assert adm.headroom(b) == 2


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), num_blocks=st.integers(6, 30), budget=st.integers(1, 40),
       policy=st.sampled_from(["fcfs", "mlfq"]), watermark=st.sampled_from([0.0, 0.1]),
       capacity=st.sampled_from([None, 24]))
def test_admission_keeps_kv_accounting_every_step(seed, num_blocks, budget, policy, watermark, capacity):
    """Random traffic through the admission object under each knob it reads: after every step
    the KV invariants hold, no step runs past its token budget or max_num_seqs, and everything
    finishes with every block back in the pool."""
    rng = random.Random(seed)
    kv = KVCacheManager(4, num_blocks)
    cfg = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=4, watermark=watermark,
                          policy=policy, latency_capacity_tokens=capacity)
    sched = Scheduler(cfg, kv, make_policy(policy), max_model_len=num_blocks * 4)
    shared = [rng.randrange(VOCAB) for _ in range(8)]
    n = 0
    for step in range(400):
        if n < 10 and rng.random() < 0.3:
            prefix = shared if rng.random() < 0.5 else []
            prompt = prefix + [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 12))]
            if len(prompt) + 6 <= sched.state.max_model_len:
                sched.add_request(Request(f"r{n}", prompt, SamplingParams(max_tokens=rng.randrange(1, 6)), step * 0.01))
                n += 1
        if not sched.has_unfinished_requests():
            if n >= 10:
                break
            continue
        run_step(sched, step * 0.01)
    assert not sched.has_unfinished_requests()
    expire_retained(sched)
    assert kv.num_held_blocks() == 0 and kv.num_free_blocks == num_blocks
