"""The correct ways of computing each kind of attention, among which a measurement chooses.

Three kinds of work (AttentionKind): decodes (one query token over its cached context), prefill
chunks from position 0 (causal over their own tokens only) and chunks that extend cached context
(a turn appended to a held history). Each has backends (AttentionBackend):
- NATIVE: segue/model/csrc's kernels, reading K/V blocks in place (no gather, no mask).
- SDPA: torch's scaled_dot_product_attention. For an extend it runs as two parts, the cached
  prefix without a mask and the chunk's own tokens causally, merged exactly by their log-sum-exps
  (torch's CPU flash kernel returns them): no [n x ctx] mask is built or read.
- SDPA_MASK: torch's SDPA over the gathered context with a dense causal mask (any device).
torch's kernels dispatch per ISA (oneDNN brgemm: AMX where the CPU has it, AVX-512, AVX2); the
native ones were tuned on one CPU. Which is fastest differs by machine, so attention_table.py
times them where they run. All are the same math up to the storage dtype's rounding.
"""
from __future__ import annotations

from enum import Enum

import torch
import torch.nn.functional as F


class AttentionKind(str, Enum):
    DECODE = "decode"
    PREFILL = "prefill"   # a chunk starting at position 0
    EXTEND = "extend"     # a chunk continuing cached context


class AttentionBackend(str, Enum):
    NATIVE = "native"
    SDPA = "sdpa"
    SDPA_MASK = "sdpa-mask"


def lse_merge_available(device: torch.device) -> bool:
    """torch's CPU flash kernel returns its log-sum-exp; other devices take SDPA_MASK for extends."""
    return device.type == "cpu" and hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu")


def gather_context(cache_layer: torch.Tensor, block_ids: torch.Tensor, ctx: int, dtype: torch.dtype) -> torch.Tensor:
    """[kv_heads, ctx, dim]: a sequence's first `ctx` cached rows, copied out of its blocks."""
    kvh, hd = cache_layer.shape[0], cache_layer.shape[-1]
    return cache_layer.index_select(1, block_ids).to(dtype).view(kvh, -1, hd)[:, :ctx]


def sdpa_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, blocks: torch.Tensor,
                mask: torch.Tensor, scale: float) -> torch.Tensor:
    """q [nd, heads, dim] over padded block tables `blocks` [nd * max_blocks] with `mask`
    [nd, 1, 1, max_blocks * block_size]; returns [nd, heads * dim]."""
    nd, nh, hd = q.shape
    kvh = k_cache.shape[0]
    # [kvh, nd * blocks, block, hd] -> [nd, kvh, ctx, hd] as strided views; SDPA picks the fused
    # kernel for the device and groups heads itself.
    k = k_cache.index_select(1, blocks).to(q.dtype).view(kvh, nd, -1, hd).transpose(0, 1)
    v = v_cache.index_select(1, blocks).to(q.dtype).view(kvh, nd, -1, hd).transpose(0, 1)
    out = F.scaled_dot_product_attention(q.unsqueeze(2), k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    return out.reshape(nd, nh * hd)


def sdpa_prefill(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, scale: float) -> torch.Tensor:
    """A chunk from position 0: q [n, heads, dim] causally over its own K/V [n, kv_heads, dim]."""
    n, nh, hd = q.shape
    out = F.scaled_dot_product_attention(q.transpose(0, 1).unsqueeze(0), k_new.transpose(0, 1).unsqueeze(0),
                                         v_new.transpose(0, 1).unsqueeze(0), is_causal=True, scale=scale,
                                         enable_gqa=True)
    return out.squeeze(0).transpose(0, 1).reshape(n, nh * hd)


def causal_mask(start_pos: int, n: int, device: torch.device) -> torch.Tensor:
    """bool [n, start_pos + n]: True where a chunk's query may attend."""
    q_pos = torch.arange(start_pos, start_pos + n, device=device)
    return torch.arange(start_pos + n, device=device)[None, :] <= q_pos[:, None]


def sdpa_extend_masked(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_ids: torch.Tensor,
                       start_pos: int, scale: float, mask: torch.Tensor | None = None) -> torch.Tensor:
    """A chunk at `start_pos` over the gathered context [0, start_pos + n) with a dense causal mask
    (`mask`: causal_mask's, when the caller built it once for every layer)."""
    n, nh, hd = q.shape
    ctx = start_pos + n
    k = gather_context(k_cache, block_ids, ctx, q.dtype).unsqueeze(0)
    v = gather_context(v_cache, block_ids, ctx, q.dtype).unsqueeze(0)
    if mask is None:
        mask = causal_mask(start_pos, n, q.device)
    out = F.scaled_dot_product_attention(q.transpose(0, 1).unsqueeze(0), k, v, attn_mask=mask, scale=scale,
                                         enable_gqa=True)
    return out.squeeze(0).transpose(0, 1).reshape(n, nh * hd)


def sdpa_extend_lse(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, block_ids: torch.Tensor, start_pos: int, scale: float) -> torch.Tensor:
    """A chunk at `start_pos`: every query sees the whole cached prefix [0, start_pos) (no mask)
    and its own chunk causally; the two softmaxes are merged by their log-sum-exps."""
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    n, nh, hd = q.shape
    kvh = k_cache.shape[0]
    group = nh // kvh
    k_pre = gather_context(k_cache, block_ids, start_pos, q.dtype).unsqueeze(0)
    v_pre = gather_context(v_cache, block_ids, start_pos, q.dtype).unsqueeze(0)
    # The prefix has no mask, so a KV head's query heads can be stacked as extra query rows: GQA
    # without repeating the (long) prefix K/V.
    q_grouped = q.view(n, kvh, group, hd).permute(1, 2, 0, 3).reshape(1, kvh, group * n, hd)
    out_pre, lse_pre = flash(q_grouped, k_pre, v_pre, scale=scale)
    out_pre = out_pre.view(kvh, group, n, hd).reshape(nh, n, hd)
    lse_pre = lse_pre.reshape(nh, n)
    # The chunk's own part is causal by row, which stacking would break; its K/V are only n rows.
    out_new, lse_new = flash(q.transpose(0, 1).unsqueeze(0),
                             k_new.transpose(0, 1).repeat_interleave(group, 0).unsqueeze(0),
                             v_new.transpose(0, 1).repeat_interleave(group, 0).unsqueeze(0),
                             is_causal=True, scale=scale)
    out_new, lse_new = out_new.squeeze(0), lse_new.squeeze(0)
    lse = torch.logaddexp(lse_pre, lse_new)
    out = out_pre.float() * (lse_pre - lse).exp_().unsqueeze(-1)
    out.add_(out_new.float() * (lse_new - lse).exp_().unsqueeze(-1))
    return out.to(q.dtype).transpose(0, 1).reshape(n, nh * hd)
