"""The decoder layer's elementwise steps, each run natively or as torch ops, whichever was measured
faster at the batch's row count (segue/model/fused_table.py).

The native forms (segue/model/csrc/fused_ops.cpp) are one pass over the rows, which wins where
per-op dispatch dominates (a decode step of a small model); torch's forms are several vectorized
ops each, dispatched per ISA, which can win on wide rows. Both compute in fp32 whatever the
storage dtype and round once, so they are the same math.
"""
from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import torch
import torch.nn.functional as F

from segue.model import timing

OPS = ("add_rms_norm", "rope_and_cache", "silu_mul")


def add_rms_norm(h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """h += delta (in place); returns rms_norm(h) * weight."""
    if delta is not None:
        h.add_(delta)
    x = h.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return (weight.float() * x).to(h.dtype)


@dataclass(frozen=True)
class Rope:
    """What rotating a layer's qkv needs besides the rows: the fp32 cos/sin tables [max_pos, dim / 2]
    and the heads a row splits into. The same for every layer, so the model builds it once."""
    cos: torch.Tensor
    sin: torch.Tensor
    num_heads: int
    num_kv_heads: int


def rope_and_cache(qkv: torch.Tensor, positions: torch.Tensor, rope: Rope, k_cache: torch.Tensor,
                   v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Q and K of qkv [T, (heads + 2 kv_heads) * dim] rotated in place (HF's rotate_half form); K and
    V written to the cache slots. The native kernel takes the same values with `rope` spread out."""
    cos, sin, num_heads, num_kv_heads = rope.cos, rope.sin, rope.num_heads, rope.num_kv_heads
    hd = k_cache.shape[-1]
    half = hd // 2
    heads = qkv.view(qkv.shape[0], num_heads + 2 * num_kv_heads, hd)
    qk = heads[:, :num_heads + num_kv_heads]
    c, s = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)
    x1, x2 = qk[..., :half].float(), qk[..., half:].float()
    qk.copy_(torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1))
    k, v = heads[:, num_heads:num_heads + num_kv_heads], heads[:, num_heads + num_kv_heads:]
    k_cache.view(num_kv_heads, -1, hd).index_copy_(1, slot_mapping, k.transpose(0, 1).to(k_cache.dtype))
    v_cache.view(num_kv_heads, -1, hd).index_copy_(1, slot_mapping, v.transpose(0, 1).to(v_cache.dtype))


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    if gate_up.dtype == torch.float32:
        return F.silu(gate) * up
    return (F.silu(gate.float()) * up.float()).to(gate_up.dtype)


class FusedOps:
    """Calls each op in the form chosen for the batch's row count: `chosen[op]` maps timed row
    counts to "native" or "torch"; a count between two timed ones follows the larger."""

    def __init__(self, kernels: ModuleType, chosen: dict[str, dict[int, str]] | None = None) -> None:
        self.kernels = kernels
        self.chosen = {op: dict(sorted(rows.items())) for op, rows in (chosen or {}).items()}
        self._ladders = {op: tuple(rows) for op, rows in self.chosen.items()}

    def _native(self, op: str, rows: int) -> bool:
        forms = self.chosen.get(op)
        return not forms or forms[timing.bucket(self._ladders[op], rows)] == "native"

    def add_rms_norm(self, h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor,
                     eps: float) -> torch.Tensor:
        impl = self.kernels.add_rms_norm if self._native("add_rms_norm", h.shape[0]) else add_rms_norm
        return impl(h, delta, weight, eps)

    def rope_and_cache(self, qkv: torch.Tensor, positions: torch.Tensor, rope: Rope, k_cache: torch.Tensor,
                       v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        if self._native("rope_and_cache", qkv.shape[0]):
            self.kernels.rope_and_cache(qkv, positions, rope.cos, rope.sin, k_cache, v_cache, slot_mapping,
                                        rope.num_heads, rope.num_kv_heads)
        else:
            rope_and_cache(qkv, positions, rope, k_cache, v_cache, slot_mapping)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        impl = self.kernels.silu_mul if self._native("silu_mul", gate_up.shape[0]) else silu_mul
        return impl(gate_up)
