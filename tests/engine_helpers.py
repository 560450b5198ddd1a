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


def hf_model_from_weights(config, weights: dict[str, torch.Tensor]) -> transformers.LlamaForCausalLM:
    """A transformers Llama built from a loaded checkpoint's weights (fp32 reference forward)."""
    hf_config = transformers.LlamaConfig(
        vocab_size=config.vocab_size, hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size, num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_heads, num_key_value_heads=config.num_kv_heads,
        head_dim=config.head_dim, max_position_embeddings=config.max_position_embeddings,
        rms_norm_eps=config.rms_norm_eps, rope_theta=config.rope_theta,
        tie_word_embeddings=config.tie_word_embeddings)
    model = transformers.LlamaForCausalLM(hf_config).to(torch.float32).eval()
    missing, unexpected = model.load_state_dict(weights, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    if config.tie_word_embeddings:
        model.tie_weights()
    return model
