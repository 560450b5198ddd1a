"""Pause and resume on a real (tiny) model: the output equals an uninterrupted greedy generation
over the same context, whatever happens to the KV while paused."""
from __future__ import annotations

import functools
import random

import pytest
import torch
import transformers

import engine_helpers
from conftest import make_tiny_checkpoint
from engine_helpers import hf_greedy, run_to_completion
from segue.config import CacheConfig, EngineConfig
from segue.engine.engine_request import EngineRequest
from segue.sampling_params import SamplingParams
from segue.sched.interception import INTERCEPTION_POLICIES
from segue.sim.script import scripted
from segue.sim.trace import TraceSegment


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = make_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny")
    model = transformers.AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
    return path, model


# Small blocks and step budget, so a few short requests already preempt, pause and swap.
make_engine = functools.partial(engine_helpers.make_engine, block_size=4, kv_tokens=2048, swap_tokens=4096,
                                budget=48, quantization="none")


def reference(model, prompt: list[int], script: list[TraceSegment]) -> list[int]:
    context, output = list(prompt), []
    for seg in script:
        gen = hf_greedy(model, context, seg.generate_tokens)
        output += gen + (seg.append_tokens if seg.interception_s is not None else [])
        context += gen + (seg.append_tokens if seg.interception_s is not None else [])
    return output


def scripts(seed: int, n: int):
    rng = random.Random(seed)
    for _ in range(n):
        prompt = [rng.randrange(100, 40000) for _ in range(rng.randrange(5, 40))]
        segs = [TraceSegment(rng.randrange(1, 6), rng.choice([0.0, 0.01, 0.05]),
                             [rng.randrange(100, 40000) for _ in range(rng.randrange(0, 9))], kind="tool")
                for _ in range(rng.randrange(1, 4))]
        segs.append(TraceSegment(rng.randrange(1, 6)))
        yield prompt, segs


@pytest.mark.parametrize("policy", sorted(INTERCEPTION_POLICIES))
def test_pause_resume_equals_uninterrupted_generation(tiny, policy):
    path, model = tiny
    engine = make_engine(path, policy=policy)
    batch = list(scripts(7, 5))
    ids = [scripted(engine).add_request(EngineRequest(p, SamplingParams(temperature=0)), s).request_id
           for p, s in batch]
    results = run_to_completion(engine)
    for rid, (prompt, script) in zip(ids, batch, strict=True):
        assert results[rid].outputs[0].token_ids == reference(model, prompt, script), policy
    assert engine.scheduler.state.kv.num_held_blocks() == 0 and not engine.scheduler.state.kv.host_tables


def test_dispositions_really_happen(tiny):
    """Swap moves blocks out and (what the device cache lost) back in, discard recomputes, preserve
    holds memory idle (waste)."""
    path, _ = tiny
    seen = {}
    for policy in ("swap", "discard", "preserve"):
        engine = make_engine(path, policy=policy)
        copies = {"out": 0, "in": 0}
        execute = engine.executor.execute

        def counting(out, execute=execute, copies=copies):
            copies["out"] += len(out.blocks_to_swap_out)
            copies["in"] += len(out.blocks_to_swap_in)
            return execute(out)
        engine.executor.execute = counting
        for prompt, script in scripts(3, 3):
            scripted(engine).add_request(EngineRequest(prompt, SamplingParams(temperature=0)), script)
        run_to_completion(engine)
        seen[policy] = (copies, engine.waste.totals)
    # Coming back, a block the device cache still holds is shared again instead of copied.
    assert seen["swap"][0]["out"] > 0 and 0 < seen["swap"][0]["in"] <= seen["swap"][0]["out"]
    assert seen["discard"][1].recompute_gbs > 0 and seen["discard"][0]["out"] == 0
    assert seen["preserve"][1].preserved_idle_gbs > 0 and seen["preserve"][1].recompute_gbs == 0


@pytest.mark.parametrize("policy", ["preserve", "swap", "discard"])
def test_cut_context_then_resume_equals_generation_over_the_new_context(tiny, policy):
    """resume(keep=k): the context after its first k tokens is replaced by the new tokens (a session
    turn that re-renders differently); greedy, the output goes on exactly as a fresh request over
    the kept prefix plus the new tokens would. Cutting into the prompt is refused and changes nothing."""
    from segue.sampling_params import InvalidRequestError
    path, model = tiny
    engine = make_engine(path, policy=policy)
    prompt = list(range(1000, 1030))
    engine.add_request(EngineRequest(prompt, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True), "a"))
    req = engine.scheduler.state.requests["a"]
    while req.num_generated_tokens < 9:
        engine.step()
    engine.intercept("a")
    for _ in range(3):  # the disposition acts and its copies complete
        engine.step()
        engine.check_invariants()
    held = list(req.all_token_ids)
    with pytest.raises(InvalidRequestError):
        engine.resume("a", [5, 6], keep=len(prompt) - 1)
    assert engine.paused_token_ids("a") == held
    new = [3000, 3001, 3002, 3003]
    engine.resume("a", new, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), keep=len(prompt) + 5)
    out = run_to_completion(engine)["a"].outputs[0]
    context = held[:len(prompt) + 5] + new
    assert out.token_ids[-6:] == hf_greedy(model, context, 6)
    assert out.token_ids[:-6] == context[len(prompt):]
    assert engine.scheduler.state.kv.num_held_blocks() == 0 and not engine.scheduler.state.kv.host_tables


def test_abort_while_paused_and_while_swapped_frees_everything(tiny):
    path, _ = tiny
    engine = make_engine(path, policy="swap")
    prompt = list(range(1000, 1030))
    greedy = SamplingParams(temperature=0)
    scripts = scripted(engine)
    scripts.add_request(EngineRequest(prompt, greedy, "a"), [TraceSegment(2, 10.0, [5, 6]), TraceSegment(3)])
    scripts.add_request(EngineRequest(prompt[::-1], greedy, "b"), [TraceSegment(2, 10.0, [7]), TraceSegment(3)])
    while engine.scheduler.state.paused.paused.keys() != {"a", "b"}:
        engine.step()
        engine.check_invariants()
    for _ in range(3):
        engine.step()
        engine.check_invariants()
    assert engine.scheduler.state.kv.host_tables, "the swap policy should have moved KV to the host"
    engine.abort_request("a")
    engine.check_invariants()
    engine.resume("b", [7])
    engine.abort_request("b")
    engine.check_invariants()
    assert engine.scheduler.state.kv.num_held_blocks() == 0 and not engine.scheduler.state.kv.host_tables


def test_script_that_outgrows_the_context_ends_alone(tiny):
    path, _ = tiny
    engine = make_engine(path, policy="preserve")  # tiny model: 512-token context
    engine.add_request(EngineRequest(list(range(1000, 1010)),
                                     SamplingParams(temperature=0, max_tokens=30, ignore_eos=True), "plain"))
    scripted(engine).add_request(EngineRequest([1000] * 400, SamplingParams(temperature=0), "r"),
                                 [TraceSegment(10, 0.0, [2000] * 200, kind="tool"), TraceSegment(5)])
    results = run_to_completion(engine)
    assert results["r"].outputs[0].finish_reason == "length"
    assert results["plain"].outputs[0].finish_reason == "length"
    assert len(results["plain"].outputs[0].token_ids) == 30


def test_host_tier_hit_loads_real_kv(tiny):
    """Another request's prefix found only in the host tier is copied back by the torch executor
    and generates exactly what a cold run of that request generates."""
    path, model = tiny
    engine = make_engine(path, policy="swap")
    prompt = list(range(2000, 2030))
    scripted(engine).add_request(EngineRequest(prompt, SamplingParams(temperature=0), "a"),
                                 [TraceSegment(3, 60.0, [7]), TraceSegment(2)])
    kv = engine.scheduler.state.kv
    for _ in range(50):
        engine.step()
        engine.check_invariants()
        if kv.host_tables.get("a") and not kv.tables.get("a") and kv.host_tables["a"][0].block_hash is not None:
            break
    assert kv.host_tables["a"][0].block_hash is not None, "a's context should sit in the host tier"
    kv.device.reset_prefix_cache()  # as if evicted: only the host tier has it
    copies = []
    execute = engine.executor.execute

    def counting(out):
        copies.extend(out.blocks_to_swap_in)
        return execute(out)
    engine.executor.execute = counting
    longer = prompt + [5, 6, 7]
    b = engine.add_request(EngineRequest(longer, SamplingParams(temperature=0, max_tokens=6), "b"))
    while not b.is_finished:
        engine.step()
        engine.check_invariants()
    assert b.num_cached_tokens >= 28 and len(copies) >= 7
    assert b.output_token_ids == hf_greedy(model, longer, 6)


def test_pause_hints_through_the_engine():
    """A caller's hints about a paused request go through the engine's public methods (the server
    uses them instead of the scheduler's state): the expected pause counts from its start."""
    import math

    from segue.sched.cost_model import CostModel
    from segue.sim.engine import make_sim_engine
    engine = make_sim_engine(CostModel(), 1024, EngineConfig(cache=CacheConfig(block_size=16)))
    prompt = list(range(100, 140))
    engine.add_request(EngineRequest(prompt, SamplingParams(temperature=0, max_tokens=8), "a"))
    while not engine.scheduler.state.requests["a"].output_token_ids:
        engine.step()
    assert engine.paused_token_ids("a") is None and not engine.expect_resume("a", 3.0)
    engine.intercept("a")
    req = engine.scheduler.state.requests["a"]
    assert engine.paused_token_ids("a") == req.all_token_ids and engine.paused_token_ids("nobody") is None
    engine.clock.advance_to(engine.clock() + 1.0)  # the hint arrives a second into the pause
    assert engine.expect_resume("a", 3.0) and req.interception.expected_duration == pytest.approx(3.0)
    assert engine.abandon("a") and req.interception.expected_duration == math.inf
    assert engine.scheduler.state.kv.num_device_blocks_of("a") == 0 and not engine.abandon("nobody")
    engine.resume("a", [7])
    while engine.has_unfinished_requests():
        engine.step()
        engine.check_invariants()
