"""Helpers shared by engine tests: a reference greedy decoder built on transformers."""
from __future__ import annotations

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

