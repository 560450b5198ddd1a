"""Cutting a paused request's context (PausedRequests.truncate, LLMEngine.resume's `keep`): a
session turn whose held tokens differ from what the next turn renders keeps the common prefix
and replaces the rest. Whatever the disposition left the context in (on the device, on the
host, released into the prefix cache), the request then computes exactly the new tail, reads
correct KV everywhere (the fake executor checks every slot a step reads) and keeps the KV
invariants after every step."""
from __future__ import annotations

import pytest
from test_kv_tiers import BS, make, run_until_generated, step

from segue.request import Disposition, Request
from segue.sampling_params import SamplingParams

PROMPT = list(range(200, 215))  # 15 tokens: three full blocks and three tokens of a fourth


@pytest.mark.parametrize("policy", ["preserve", "swap", "discard"])
def test_cut_context_recomputes_only_from_the_cut(policy: str) -> None:
    sched, ex = make(policy)
    a = Request("a", list(PROMPT), SamplingParams(max_tokens=20), 0.0)
    sched.add_request(a)
    now = run_until_generated(sched, ex, a, 10, 0.0)
    original = list(a.all_token_ids)
    sched.intercept_request(a, now)
    for _ in range(2):  # the disposition acts, then its copies complete
        now += 0.01
        step(sched, ex, now)
    assert a.interception.disposition is Disposition(policy)
    keep = len(PROMPT) + 3  # mid-block: 18 tokens, four whole blocks
    sched.state.paused.truncate(a, keep)
    sched.check_invariants()
    assert a.all_token_ids == original[:keep] and a.num_generated_tokens == 10
    assert a.num_computed_tokens <= keep // BS * BS
    assert sched.state.kv.num_device_blocks_of("a") + sched.state.kv.num_host_blocks_of("a") <= keep // BS
    sched.resume_request(a, [70, 71, 72], now)
    assert a.all_token_ids == original[:keep] + [70, 71, 72]
    starts = []
    while not a.is_finished:
        now += 0.01
        out, _ = step(sched, ex, now)
        starts += [s.start_pos for s in out.seqs if s.request is a]
    # The kept whole blocks are never computed again; the two kept tokens of the partial block are.
    assert starts[0] == keep // BS * BS
    # The cut tokens still count as generated: max_tokens (20) counts what the model produced.
    assert a.num_generated_tokens == 20 and a.num_cut_tokens == len(original) - keep


def test_cut_blocks_stay_findable_for_other_requests() -> None:
    sched, ex = make("preserve")
    a = Request("a", list(PROMPT), SamplingParams(max_tokens=20), 0.0)
    sched.add_request(a)
    now = run_until_generated(sched, ex, a, 10, 0.0)
    original = list(a.all_token_ids)
    sched.intercept_request(a, now)
    sched.state.paused.truncate(a, len(PROMPT))
    assert sched.state.kv.num_device_blocks_of("a") == len(PROMPT) // BS
    # Blocks published before the cut were freed into the prefix cache, not destroyed.
    b = Request("b", original[:24] + [1], SamplingParams(max_tokens=2), now)
    assert sched.state.kv.match(b).num_blocks == 6
    sched.check_invariants()


