"""The engine's greedy output equals transformers' token for token, on a tiny random checkpoint
loaded through the real loader, across batching, chunked prefill, prefix hits and preemption."""
from __future__ import annotations

import functools
import random

import pytest
import torch
import transformers

import engine_helpers
from conftest import make_tiny_checkpoint
from engine_helpers import hf_greedy, run_to_completion
from segue.engine.engine_request import EngineRequest
from segue.engine.llm_engine import LLMEngine
from segue.sampling_params import SamplingParams

MAX_NEW = 12


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def tiny(request, tmp_path_factory):
    path = make_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / request.param, arch=request.param)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
    return path, model


# Unquantized, so outputs compare with transformers' token for token; a small step budget.
make_engine = functools.partial(engine_helpers.make_engine, budget=256, max_seqs=32, quantization="none")


def prompts(seed: int, n: int, shared_prefix: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(100, 40000) for _ in range(shared_prefix)]
    return [prefix + [rng.randrange(100, 40000) for _ in range(rng.randrange(1, 90))] for _ in range(n)]


def check_against_hf(engine: LLMEngine, model, batch: list[list[int]]) -> dict:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    ids = [engine.add_request(EngineRequest(p, params)).request_id for p in batch]
    results = run_to_completion(engine)
    for rid, prompt in zip(ids, batch, strict=True):
        assert results[rid].outputs[0].token_ids == hf_greedy(model, prompt, MAX_NEW), f"prompt of {len(prompt)} tokens"
    return results


@pytest.mark.parametrize("torch_attention", [False, True], ids=["native-attention", "torch-attention"])
def test_mixed_prompt_lengths(tiny, torch_attention):
    path, model = tiny
    check_against_hf(make_engine(path, torch_attention=torch_attention), model, prompts(0, 8))


# Every backend the measured plan can pick for a kind of attention ("auto": this machine's choice).
ATTENTION = pytest.mark.parametrize("attention", ["auto", "native", "sdpa", "sdpa-mask"])


@ATTENTION
def test_chunked_prefill(tiny, attention):
    path, model = tiny
    engine = make_engine(path, budget=7, block_size=4, attention=attention)
    check_against_hf(engine, model, prompts(1, 5))


@ATTENTION
def test_prefix_cache_hits(tiny, attention):
    path, model = tiny
    engine = make_engine(path, block_size=4, attention=attention)
    batch = prompts(2, 4, shared_prefix=40)
    check_against_hf(engine, model, batch[:1])
    results = check_against_hf(engine, model, batch[1:] + batch[:1])
    assert all(r.num_cached_tokens >= 40 for r in results.values())
    assert engine.scheduler.state.prefix_hit_tokens > 0


def test_preemption_with_recompute(tiny):
    path, model = tiny
    # 24 blocks of 4 tokens cannot hold eight growing sequences at once: some get preempted.
    engine = make_engine(path, block_size=4, kv_tokens=96, budget=64, prefix_caching=False)
    batch = [p[:60] for p in prompts(3, 8)]
    check_against_hf(engine, model, batch)
    assert engine.scheduler.state.num_preemptions_total > 0


@pytest.fixture(scope="module")
def wide_heads(tmp_path_factory):
    """4 query / 2 KV heads of 128, as Llama-3 and Qwen2.5-1.5B+ have (the default model's are 64)."""
    path = make_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "wide", arch="qwen2", head_dim=128)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
    return path, model


@ATTENTION
def test_128_wide_heads_chunked_and_over_cached_prefixes(wide_heads, attention):
    path, model = wide_heads
    engine = make_engine(path, budget=24, block_size=4, attention=attention)
    batch = prompts(4, 4, shared_prefix=40)
    check_against_hf(engine, model, batch[:1])
    results = check_against_hf(engine, model, batch[1:])
    assert all(r.num_cached_tokens >= 40 for r in results.values())
