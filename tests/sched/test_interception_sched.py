"""Interceptions in the pure scheduler: random pauses and resumes under every policy, with a fake
executor that tracks the token held in every KV slot so that swaps, discards and prefix hits are
checked for content, not just bookkeeping."""
from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from fake_executor import VOCAB, FakeKVExecutor, PlannedPauses
from segue.config import SchedulerConfig
from segue.kv.manager import KVCacheManager
from segue.request import Request, RequestStatus
from segue.sampling_params import SamplingParams
from segue.sched.cost_model import CostModel
from segue.sched.interception import INTERCEPTION_POLICIES, make_interception_policy
from segue.sched.policies import make_policy
from segue.sched.scheduler import Scheduler


@settings(max_examples=80, deadline=None)
@given(seed=st.integers(0, 10_000), policy=st.sampled_from(sorted(INTERCEPTION_POLICIES)),
       num_blocks=st.integers(12, 40), host_blocks=st.integers(0, 40), caching=st.booleans())
def test_random_pauses_and_resumes_keep_kv_correct(seed, policy, num_blocks, host_blocks, caching):
    rng = random.Random(seed)
    bs = 4
    kv = KVCacheManager(bs, num_blocks, host_blocks, enable_prefix_caching=caching)
    cost = CostModel(fwd_ms_per_token=1.0, fwd_base_ms=5.0, saturation_tokens=16,
                     swap_bytes_per_s=rng.choice([1e3, 1e5, 1e9]), kv_bytes_per_token=100)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=rng.randrange(4, 40), max_num_seqs=6), kv,
                      make_policy("fcfs"), max_model_len=num_blocks * bs // 2,
                      interception=make_interception_policy(policy), cost=cost)
    ex = FakeKVExecutor(bs)
    reqs, pauses = [], PlannedPauses(rng)
    # Most requests share a system prompt, so dispositions meet blocks shared through the cache.
    system = [rng.randrange(VOCAB) for _ in range(rng.choice([0, 4, 9, 12]))]
    for i in range(rng.randrange(1, 8)):
        prompt = [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 10))]
        if rng.random() < 0.7:
            prompt = system + prompt
        max_tokens = rng.randrange(2, 8)
        pause_at = pauses.draw(max_tokens)
        if len(prompt) + max_tokens + 6 > sched.state.max_model_len:
            continue
        req = Request(f"r{i}", prompt, SamplingParams(max_tokens=max_tokens), float(i))
        reqs.append(req)
        pauses.plans[req.request_id] = pause_at
        sched.add_request(req)
    now = 0.0
    for _ in range(3000):
        if not sched.has_unfinished_requests():
            break
        now += 0.01
        pauses.resume_due(sched, now)
        if caching and rng.random() < 0.05:
            kv.device.reset_prefix_cache()  # as if evicted: later hits must come from the host tier
        out = sched.schedule(now)
        sampled = ex.execute(out)
        got = sched.update_from_output(out, sampled)
        pauses.pause_planned(sched, (u.request for u in got), now, expected_s=(None, 0.05))
        sched.check_invariants()
    assert not sched.has_unfinished_requests(), "requests left unfinished"
    assert kv.num_held_blocks() == 0 and not kv.host_tables
    for req in reqs:
        assert req.status == RequestStatus.FINISHED_LENGTH
        assert req.output_token_ids == pauses.expected(req)


class _ByPriority(make_policy("fcfs").__class__):
    """A non-preemptive order set per request id (lower first), like LAMPS's scores."""
    name = "test-by-priority"

    def __init__(self, priority: dict[str, int]) -> None:
        super().__init__()
        self.priority = priority

    def key(self, request: Request, now: float) -> tuple[int, int]:
        return (self.priority.get(request.request_id, 0), request.seq_no)


def test_resumed_preserved_context_rejoins_the_running_requests_under_a_non_fcfs_order():
    """A preserved pause that ends keeps its KV; ranked behind a new request that cannot get memory,
    it must not wait holding the memory the newcomer needs (nor lose its context to it): it runs
    on, as in vLLM's running queue."""
    bs = 4
    kv = KVCacheManager(bs, 10, 0, enable_prefix_caching=False)
    policy = _ByPriority({"long": 1, "new": 0})
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=4), kv, policy, max_model_len=40,
                      interception=make_interception_policy("preserve"))
    long = Request("long", list(range(20)), SamplingParams(max_tokens=8), 0.0)
    sched.add_request(long)
    out = sched.schedule(0.0)
    sched.update_from_output(out, {"long": 1})
    sched.intercept_request(long, 0.1)
    sched.check_invariants()
    new = Request("new", list(range(24)), SamplingParams(max_tokens=4), 0.2)
    sched.add_request(new)  # 6 blocks: does not fit beside the paused context's 6
    sched.resume_request(long, [2, 3], 0.3)
    out = sched.schedule(0.3)
    sched.check_invariants()
    [seq] = out.seqs
    # It runs on from its KV: the 20 computed tokens stay, the sampled one and the 2 appended are new.
    assert seq.request is long and seq.start_pos == 20 and seq.num_tokens == 3
    assert long.num_preemptions == 0 and long.status == RequestStatus.RUNNING
    assert new.status == RequestStatus.WAITING
