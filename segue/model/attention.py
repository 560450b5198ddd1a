"""Attention over the paged KV cache, each kind of work through the backend chosen for it.

A step's rows come as decodes (one query token each), then prefill chunks that run the native
paged prefill kernel (one varlen call for all of them: blocks read in place, causal offset inside),
then chunks that run a torch backend one at a time. Which backend a decode batch or a chunk takes
is the measured attention plan's choice (segue/model/attention_table.py; the backends themselves
are in segue/model/attention_backends.py). GQA never repeats the cached K/V.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from types import ModuleType

import torch

from segue.model.attention_backends import (
    AttentionBackend,
    sdpa_decode,
    sdpa_extend_lse,
    sdpa_extend_masked,
    sdpa_prefill,
)
from segue.model.kv_tensors import KVTensors


@dataclass
class PrefillChunk:
    """A chunk that runs a torch backend on its own."""
    token_start: int      # first row of this chunk in the step's token batch
    token_end: int
    start_pos: int        # position of the chunk's first token in its sequence
    block_ids: torch.Tensor
    backend: AttentionBackend = AttentionBackend.SDPA
    mask: torch.Tensor | None = None  # bool [n, ctx] for SDPA_MASK, built once per step


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor                 # [T] cache slot of every new token
    num_decodes: int = 0                       # decode tokens come first in the batch
    decode_blocks: torch.Tensor | None = None  # [num_decodes * max_blocks] padded block ids
    decode_mask: torch.Tensor | None = None    # [num_decodes, 1, 1, max_blocks * block_size] bool
    decode_context_lens: torch.Tensor | None = None  # [num_decodes]
    # The native CPU kernel module when the decodes run the native kernel, else None (SDPA over
    # gathered blocks and decode_mask).
    decode_kernel: ModuleType | None = None
    # The native decode kernel sums P.V in block-table order instead of block-id order, so its
    # output does not depend on where the pool put the blocks (batch-invariant runs).
    decode_logical_order: bool = False
    # The native paged prefill kernel and its varlen arguments when some chunks run it; their
    # rows follow the decodes contiguously, then come the rows of `prefills`.
    prefill_kernel: ModuleType | None = None
    prefill_query_start: torch.Tensor | None = None   # [chunks + 1] row offsets within the native rows
    prefill_start_pos: torch.Tensor | None = None     # [chunks]
    prefill_block_tables: torch.Tensor | None = None  # [chunks, max_blocks]
    prefills: list[PrefillChunk] = field(default_factory=list)


def _decode_attention(q: torch.Tensor, cache: KVTensors, layer: int, meta: AttentionMetadata,
                      scale: float) -> torch.Tensor:
    nd, nh, hd = q.shape
    kc, vc, blocks = cache.k[layer], cache.v[layer], meta.decode_blocks
    assert blocks is not None  # set whenever the step has decodes
    if meta.decode_kernel is not None:
        out = meta.decode_kernel.paged_decode_attention(
            q, kc, vc, blocks.view(nd, -1), meta.decode_context_lens, scale, meta.decode_logical_order)
        return out.view(nd, nh * hd)
    assert meta.decode_mask is not None  # built for the SDPA decode path
    return sdpa_decode(q, kc, vc, blocks, meta.decode_mask, scale)


def _chunk_attention(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, cache: KVTensors,
                     layer: int, chunk: PrefillChunk, scale: float) -> torch.Tensor:
    if chunk.start_pos == 0:
        # Causal over its own tokens: the same for every torch backend, nothing to gather.
        return sdpa_prefill(q, k_new, v_new, scale)
    kc, vc = cache.k[layer], cache.v[layer]
    if chunk.backend is AttentionBackend.SDPA:
        return sdpa_extend_lse(q, k_new, v_new, kc, vc, chunk.block_ids, chunk.start_pos, scale)
    return sdpa_extend_masked(q, kc, vc, chunk.block_ids, chunk.start_pos, scale, chunk.mask)


def paged_attention(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, cache: KVTensors,
                    layer: int, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """q: [T, heads, dim]; k_new/v_new: this step's K/V (already written to the cache)."""
    parts = []
    nd, nh, hd = meta.num_decodes, q.shape[1], q.shape[2]
    if nd:
        parts.append(_decode_attention(q[:nd], cache, layer, meta, scale))
    if meta.prefill_kernel is not None:
        assert meta.prefill_query_start is not None
        end = nd + int(meta.prefill_query_start[-1])
        out = meta.prefill_kernel.paged_prefill_attention(
            q[nd:end], cache.k[layer], cache.v[layer], meta.prefill_query_start, meta.prefill_start_pos,
            meta.prefill_block_tables, scale)
        parts.append(out.view(-1, nh * hd))
    for chunk in meta.prefills:
        a, b = chunk.token_start, chunk.token_end
        parts.append(_chunk_attention(q[a:b], k_new[a:b], v_new[a:b], cache, layer, chunk, scale))
    return parts[0] if len(parts) == 1 else torch.cat(parts)
