"""Helpers shared by engine tests: a reference greedy decoder built on transformers, running a
request to its end, and an executor wrapper that makes a random model open tool calls."""
from __future__ import annotations

import dataclasses
from typing import Any

import torch
import transformers

from segue.engine import LLMEngine
from segue.outputs import RequestOutput


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
        assert engine.scheduler.kv.num_held_blocks() == 0, "KV blocks leaked"
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
