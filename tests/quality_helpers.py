"""Teacher-forced comparisons of a model variant (dtype, quantization) with its fp32 reference:
greedy agreement at every position of one fixed continuation, and perplexity on a fixed text.
Teacher forcing keeps one early disagreement from cascading into a different continuation."""
from __future__ import annotations

import math

import torch

from segue.kv.manager import cdiv
from segue.model.attention import AttentionMetadata, PrefillChunk
from segue.model.kv_cache import KVCache
from segue.model.llama import LlamaModel


def full_logits(model: LlamaModel, ids: list[int], block_size: int = 16, last_only: bool = False) -> torch.Tensor:
    """fp32 logits [T, V] for every position of `ids` (or [1, V] for the last), one causal
    prefill from position 0."""
    cfg, n = model.config, len(ids)
    blocks = cdiv(n, block_size)
    cache = KVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, block_size, blocks, 0,
                    model.device, model.dtype)
    dev = model.device
    meta = AttentionMetadata(slot_mapping=torch.arange(n, device=dev))
    meta.prefills = [PrefillChunk(0, n, 0, torch.arange(blocks, device=dev), None)]
    hidden = model.forward(torch.tensor(ids, device=dev), torch.arange(n, device=dev), meta, cache)
    return model.compute_logits(hidden[-1:] if last_only else hidden).float().cpu()


def greedy_continuation(model: LlamaModel, prompt: list[int], n: int, block_size: int = 16) -> list[int]:
    """The model's greedy continuation: one prefill, then one decode step per token over the cache."""
    return _decode_over_cache(model, prompt, n, None, None, block_size).argmax(-1).tolist()


def agreement(ref: LlamaModel, other: LlamaModel, prompts: list[list[int]], continuations: list[list[int]]) -> float:
    """Share of continuation positions where both models pick the same greedy token."""
    same = total = 0
    for prompt, cont in zip(prompts, continuations, strict=True):
        ids = prompt + cont
        start = len(prompt) - 1
        a = full_logits(ref, ids)[start:-1].argmax(-1)
        b = full_logits(other, ids)[start:-1].argmax(-1)
        same += int((a == b).sum())
        total += len(cont)
    return same / total


def perplexity(model: LlamaModel, ids: list[int]) -> float:
    logp = torch.log_softmax(full_logits(model, ids)[:-1], dim=-1)
    nll = -logp.gather(1, torch.tensor(ids[1:]).unsqueeze(1)).mean()
    return math.exp(float(nll))


def decode_logits(model: LlamaModel, prompt: list[int], forced: list[int], kv_dtype: torch.dtype | None = None,
                  block_size: int = 16) -> torch.Tensor:
    """fp32 logits [len(forced), V]: row i predicts forced[i] from prompt + forced[:i], computed by
    one decode step per token over a paged cache of `kv_dtype` (default: the model's). Unlike
    full_logits, every position reads its context back from the cache, so a cache that stores less
    precision than the model shows here."""
    return _decode_over_cache(model, prompt, len(forced), forced, kv_dtype, block_size)


def _decode_over_cache(model: LlamaModel, prompt: list[int], n: int, forced: list[int] | None,
                       kv_dtype: torch.dtype | None, block_size: int) -> torch.Tensor:
    """fp32 logits [n, V] of one prefill of `prompt` and n - 1 decode steps over a paged cache,
    fed `forced` (teacher forcing) or, without it, each step's own greedy token."""
    cfg, dev = model.config, model.device
    blocks = cdiv(len(prompt) + n, block_size)
    cache = KVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, block_size, blocks, 0, dev,
                    kv_dtype or model.dtype)
    table = torch.arange(blocks, device=dev)
    p = len(prompt)
    meta = AttentionMetadata(slot_mapping=torch.arange(p, device=dev))
    if model.kernels is not None and cfg.head_dim == 64:  # the native paged prefill, as the engine runs it
        meta.prefill_kernel = model.kernels
        meta.prefill_query_start = torch.tensor([0, p])
        meta.prefill_start_pos = torch.tensor([0])
        meta.prefill_block_tables = table[:cdiv(p, block_size)].view(1, -1)
    else:
        meta.prefills = [PrefillChunk(0, p, 0, table[:cdiv(p, block_size)])]
    hidden = model.forward(torch.tensor(prompt, device=dev), torch.arange(p, device=dev), meta, cache)
    rows = [model.compute_logits(hidden[-1:]).float().cpu()]
    for i in range(n - 1):
        pos = p + i
        tok = forced[i] if forced is not None else int(rows[-1].argmax())
        used = cdiv(pos + 1, block_size)
        meta = AttentionMetadata(slot_mapping=torch.tensor([pos], device=dev), num_decodes=1,
                                 decode_blocks=table[:used], decode_context_lens=torch.tensor([pos + 1], device=dev),
                                 decode_kernel=model.kernels)
        if model.kernels is None:
            meta.decode_mask = (torch.arange(used * block_size, device=dev) <= pos).view(1, 1, 1, -1)
        hidden = model.forward(torch.tensor([tok], device=dev), torch.tensor([pos], device=dev), meta, cache)
        rows.append(model.compute_logits(hidden).float().cpu())
    return torch.cat(rows)
