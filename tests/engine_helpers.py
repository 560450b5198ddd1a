"""Helpers shared by engine tests: building a CPU engine over a checkpoint (the one make_engine),
a reference greedy decoder built on transformers, running a request to its end, and an executor
wrapper that makes a random model open tool calls."""
from __future__ import annotations

import dataclasses
from typing import Any

import torch
import transformers

from segue.config import CacheConfig, EngineConfig, ModelLoadConfig, SchedulerConfig
from segue.engine.llm_engine import LLMEngine
from segue.model.attention_table import plan_attention
from segue.outputs import RequestOutput


def make_engine(path: Any, *, policy: str | None = None, block_size: int = 16, kv_tokens: int = 4096,
                swap_tokens: int | None = None, budget: int | None = None, max_seqs: int | None = None,
                prefix_caching: bool = True, quantization: str | None = None,
                torch_attention: bool = False, attention: str = "auto", batch_invariant: bool = False) -> LLMEngine:
    """A float32 CPU engine over the checkpoint at `path`. Unset options keep the configs' defaults
    (quantization "auto" among them); `torch_attention` swaps the native kernels for the pure torch
    forward (what CUDA runs); `attention` forces an attention backend (ModelLoadConfig.attention_backend);
    `batch_invariant` is ModelLoadConfig.batch_invariant."""
    cache = CacheConfig(block_size=block_size, kv_cache_tokens=kv_tokens, enable_prefix_caching=prefix_caching,
                        **({"swap_space_tokens": swap_tokens} if swap_tokens is not None else {}))
    scheduler = SchedulerConfig(**({"interception_policy": policy} if policy is not None else {}),
                                **({"max_num_batched_tokens": budget} if budget is not None else {}),
                                **({"max_num_seqs": max_seqs} if max_seqs is not None else {}))
    model = ModelLoadConfig(model=str(path), dtype="float32", device="cpu", attention_backend=attention,
                            batch_invariant=batch_invariant,
                            **({"quantization": quantization} if quantization is not None else {}))
    engine = LLMEngine(EngineConfig(model=model, cache=cache, scheduler=scheduler))
    if torch_attention:
        ex = engine.executor
        # With no native kernels a forced sdpa-mask plan is CUDA's: SDPA for decodes and fresh
        # chunks, the gathered context and a dense mask for extends.
        ex.attention = plan_attention(ex.config, ex.dtype, ex.kv_dtype, ex.device, None, "sdpa-mask")
        ex.model.kernels = None
    return engine


@torch.inference_mode()
def hf_greedy(model: transformers.PreTrainedModel, prompt: list[int], max_new_tokens: int) -> list[int]:
    """Token-by-token argmax with transformers' own forward and KV cache (no EOS stopping)."""
    ids = torch.tensor([prompt])
    out = model(ids, use_cache=True)
    past, generated = out.past_key_values, []
    for _ in range(max_new_tokens):
        token = int(out.logits[0, -1].argmax())
        generated.append(token)
        out = model(torch.tensor([[token]]), past_key_values=past, use_cache=True)
        past = out.past_key_values
    return generated


def run_to_completion(engine: LLMEngine, check: bool = True, max_steps: int = 100_000) -> dict[str, RequestOutput]:
    """Step until idle, checking the KV invariants after every step."""
    finished: dict[str, RequestOutput] = {}
    steps = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
        if check:
            engine.check_invariants()
        steps += 1
        assert steps < max_steps, "engine made no progress"
    if check:
        assert engine.scheduler.state.kv.num_held_blocks() == 0, "KV blocks leaked"
    return finished



class OpensCalls:
    """Wraps an engine's executor so that every segment (the output before the first interception,
    and after each resume) of every request starts with `opening` (a tool call's start marker).

    A random model never writes the marker by itself, so without this an "auto" tool-call test's
    checks would never run. Only the first tokens are replaced: the real forward runs, and what
    the model writes after the marker is sampled under the request's grammar (the replaced tokens
    are ones that grammar allows)."""

    def __init__(self, engine: LLMEngine, opening: list[int]) -> None:
        self.real = engine.executor.execute
        self.opening = opening
        self.progress: dict[str, tuple[int, int]] = {}
        engine.executor.execute = self  # type: ignore[method-assign]

    def __call__(self, out: Any) -> dict[str, Any]:
        sampled = self.real(out)
        for seq in out.seqs:
            req = seq.request
            if not seq.sample or req.request_id not in sampled:
                continue
            segment, pos = self.progress.get(req.request_id, (0, 0))
            if segment != len(req.interceptions):
                segment, pos = len(req.interceptions), 0
            self.progress[req.request_id] = (segment, pos + 1)
            if pos < len(self.opening):
                sampled[req.request_id] = dataclasses.replace(sampled[req.request_id], token_id=self.opening[pos])
        return sampled
