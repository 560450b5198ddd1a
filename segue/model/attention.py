"""Attention over the paged KV cache.

On CPU both kinds of work run through native kernels that read each block in place
(segue/model/csrc): decodes (one query token each) through the decode kernel, and every prefill
chunk of the step, from position 0 or continuing cached context, through one call of the paged
prefill kernel (tiled, online softmax, causal offset handled inside: no gathered context, no mask).
Elsewhere (CUDA, no compiler, head sizes the kernels lack) decodes run through
scaled_dot_product_attention over their gathered blocks with a mask built once per step, and
prefill chunks one sequence at a time through scaled_dot_product_attention (flash kernels where
available). GQA never repeats K/V: query heads are grouped per KV head instead.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from types import ModuleType

import torch
import torch.nn.functional as F

from segue.model.kv_cache import KVCache


@dataclass
class PrefillChunk:
    token_start: int      # first row of this chunk in the step's token batch
    token_end: int
    start_pos: int        # position of the chunk's first token in its sequence
    block_ids: torch.Tensor
    mask: torch.Tensor | None  # bool [n, ctx] (True = attend); None when causal from position 0


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor                 # [T] cache slot of every new token
    num_decodes: int = 0                       # decode tokens come first in the batch
    decode_blocks: torch.Tensor | None = None  # [num_decodes * max_blocks] padded block ids
    decode_mask: torch.Tensor | None = None    # [num_decodes, 1, 1, max_blocks * block_size] bool
    decode_context_lens: torch.Tensor | None = None  # [num_decodes]
    # The native CPU kernel module on CPU (fp32, bf16 or fp16 queries; a bf16 cache under fp32),
    # else None: the torch path.
    decode_kernel: ModuleType | None = None
    prefills: list[PrefillChunk] = field(default_factory=list)
    # The native paged prefill kernel and its varlen arguments when the step has prefill chunks
    # and the kernel applies (then `prefills` stays empty); else the per-chunk torch path over
    # `prefills`. Prefill rows follow the decodes contiguously.
    prefill_kernel: ModuleType | None = None
    prefill_query_start: torch.Tensor | None = None   # [chunks + 1] row offsets within the prefill rows
    prefill_start_pos: torch.Tensor | None = None     # [chunks]
    prefill_block_tables: torch.Tensor | None = None  # [chunks, max_blocks]


def _decode_attention(q: torch.Tensor, cache: KVCache, layer: int, meta: AttentionMetadata,
                      scale: float) -> torch.Tensor:
    nd, nh, hd = q.shape
    kc, vc, blocks = cache.k[layer], cache.v[layer], meta.decode_blocks
    assert blocks is not None  # set whenever the step has decodes
    if meta.decode_kernel is not None:
        out = meta.decode_kernel.paged_decode_attention(
            q, kc, vc, blocks.view(nd, -1), meta.decode_context_lens, scale)
        return out.view(nd, nh * hd)
    kvh = kc.shape[0]
    # [kvh, nd * blocks, block, hd] -> [nd, kvh, ctx, hd] as strided views; SDPA picks the fused
    # kernel for the device (flash / memory-efficient on CUDA) and groups heads itself.
    k = kc.index_select(1, blocks).to(q.dtype).view(kvh, nd, -1, hd).transpose(0, 1)
    v = vc.index_select(1, blocks).to(q.dtype).view(kvh, nd, -1, hd).transpose(0, 1)
    out = F.scaled_dot_product_attention(q.unsqueeze(2), k, v, attn_mask=meta.decode_mask,
                                         scale=scale, enable_gqa=True)   # [nd, nh, 1, hd]
    return out.reshape(nd, nh * hd)


def _prefill_attention(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, cache: KVCache,
                       layer: int, chunk: PrefillChunk, scale: float) -> torch.Tensor:
    n, nh, hd = q.shape
    qh = q.transpose(0, 1).unsqueeze(0)                           # [1, nh, n, hd]
    if chunk.mask is None:
        k = k_new.transpose(0, 1).unsqueeze(0)
        v = v_new.transpose(0, 1).unsqueeze(0)
        out = F.scaled_dot_product_attention(qh, k, v, is_causal=True, scale=scale, enable_gqa=True)
    else:
        ctx = chunk.mask.shape[-1]
        kc, vc = cache.k[layer], cache.v[layer]
        kvh = kc.shape[0]
        k = kc.index_select(1, chunk.block_ids).to(q.dtype).view(kvh, -1, hd)[:, :ctx].unsqueeze(0)
        v = vc.index_select(1, chunk.block_ids).to(q.dtype).view(kvh, -1, hd)[:, :ctx].unsqueeze(0)
        out = F.scaled_dot_product_attention(qh, k, v, attn_mask=chunk.mask, scale=scale, enable_gqa=True)
    return out.squeeze(0).transpose(0, 1).reshape(n, nh * hd)


def paged_attention(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, cache: KVCache,
                    layer: int, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """q: [T, heads, dim]; k_new/v_new: this step's K/V (already written to the cache)."""
    parts = []
    if meta.num_decodes:
        parts.append(_decode_attention(q[:meta.num_decodes], cache, layer, meta, scale))
    if meta.prefill_kernel is not None:
        nd, nh, hd = meta.num_decodes, q.shape[1], q.shape[2]
        out = meta.prefill_kernel.paged_prefill_attention(
            q[nd:], cache.k[layer], cache.v[layer], meta.prefill_query_start, meta.prefill_start_pos,
            meta.prefill_block_tables, scale)
        parts.append(out.view(-1, nh * hd))
    else:
        for chunk in meta.prefills:
            a, b = chunk.token_start, chunk.token_end
            parts.append(_prefill_attention(q[a:b], k_new[a:b], v_new[a:b], cache, layer, chunk, scale))
    return parts[0] if len(parts) == 1 else torch.cat(parts)
