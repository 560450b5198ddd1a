"""Weight-only quantized linear layers: int8 and int4 in groups of 32 along K (GGUF's Q8_0 and
Q4_1 layouts, so the default model's weights convert exactly).

Decoding a small model on a CPU streams every weight once per step, so bytes per weight set the
single-stream speed. Torch's CPU kernels for this (`_weight_int8pack_mm`,
`_weight_int4pack_mm_for_cpu`) were measured 5-15x slower than the fp32 GEMM with fp32
activations on an AVX2 CPU (BENCHMARKS.md) and take only per-channel int8 scales, so the
small-batch path is Segue's own native kernel (segue/model/csrc/quant_ops.cpp). Large batches are
compute-bound, and there the GEMM wins, so a quantized layer also keeps its dequantized weight in
the compute dtype for them. Which batch sizes go where is measured per machine
(segue/model/kernel_table.py).
"""
from __future__ import annotations

import enum
from types import ModuleType

import torch
import torch.nn.functional as F

from segue.model import timing

GROUP_SIZE = 32  # GGUF's Q8_0 / Q4_1 block: the default model's weights are exact at this size
# A `dense_above` larger than any batch: the quantized kernel takes every row.
EVERY_BATCH = 1 << 30


class Quantization(str, enum.Enum):
    NONE = "none"
    INT8 = "int8"
    INT4 = "int4"


def quantize_int8(w: torch.Tensor, group: int = GROUP_SIZE) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 in groups of `group` along K (llama.cpp's Q8_0): w ~= q * scale.
    Returns (q int8 [N, K], scale fp32 [N, K // group])."""
    n, k = w.shape
    g = w.float().view(n, k // group, group)
    scale = g.abs().amax(dim=-1).clamp(min=1e-12) / 127.0
    q = torch.round(g / scale[..., None]).clamp(-127, 127).to(torch.int8).view(n, k)
    return q, scale


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor, group: int = GROUP_SIZE) -> torch.Tensor:
    n, k = q.shape
    return (q.view(n, k // group, group).float() * scale[..., None]).view(n, k)


def quantize_int4(w: torch.Tensor, group: int = GROUP_SIZE) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric int4 in groups of `group` along K (llama.cpp's Q4_1): w ~= q * scale + lo with
    q in [0, 15]; min/max per group reproduces Q4_1 blocks exactly. Returns (q int32 [N, K],
    scale, lo) with scale/lo fp32 [N, K // group]."""
    n, k = w.shape
    g = w.float().view(n, k // group, group)
    lo, hi = g.amin(dim=-1), g.amax(dim=-1)
    scale = ((hi - lo) / 15.0).clamp(min=1e-12)
    q = torch.round((g - lo[..., None]) / scale[..., None]).clamp(0, 15).to(torch.int32).view(n, k)
    return q, scale, lo


def dequantize_int4(q: torch.Tensor, scale: torch.Tensor, lo: torch.Tensor, group: int = GROUP_SIZE) -> torch.Tensor:
    n, k = q.shape
    return (q.view(n, k // group, group).float() * scale[..., None] + lo[..., None]).view(n, k)


def group_supported(k: int) -> bool:
    return k % GROUP_SIZE == 0


def pack_int4(q: torch.Tensor, group: int = GROUP_SIZE) -> torch.Tensor:
    """[N, K] values in [0, 15] -> [N, K / 2] uint8, the native kernel's layout: byte j of a group
    holds element j (low nibble) and element j + group / 2 (high nibble)."""
    n, k = q.shape
    g = q.view(n, k // group, group).to(torch.uint8)
    half = group // 2
    return (g[..., :half] | (g[..., half:] << 4)).reshape(n, k // 2).contiguous()


class LinearWeights:
    """One linear layer's weight in the form the device runs fastest, called as `lw(x)`.

    x: [M, K] in the compute dtype; returns [M, N]. Quantized layers run batches of at most
    `dense_above` rows (decode) through the native CPU kernels (`kernels`: segue.model.cpu_kernels)
    and larger ones (prefill) through a GEMM over the dequantized weight. Without native kernels
    (CUDA, no compiler) the dequantized weight runs through F.linear: the quantized numbers,
    without the speed.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, quant: Quantization,
                 dtype: torch.dtype, kernels: ModuleType | None = None, dense_above: int = 16,
                 padded_rows: dict[int, int] | None = None) -> None:
        """`padded_rows`: the GEMM's timed row counts, each with the count it runs fastest at (the
        kernel table's padded_rows); a batch pads to the target of the smallest timed count that
        holds it, when that target is larger."""
        self.bias = bias
        self.padded_rows = dict(sorted((padded_rows or {}).items()))
        self._pad_ladder = tuple(self.padded_rows)
        self.out_features, self.in_features = weight.shape
        if not group_supported(self.in_features):
            if kernels is not None and dense_above >= EVERY_BATCH:
                # The native kernel was to take every batch (batch-invariant runs): a GEMM instead
                # would sum in an order that depends on the batch.
                raise ValueError(f"a {self.in_features}-wide input is not a whole number of groups of "
                                 f"{GROUP_SIZE}: the native quantized kernel cannot take every batch")
            quant = Quantization.NONE  # rows not a whole number of groups: keep full precision
        if kernels is not None and dense_above <= 0:
            quant = Quantization.NONE  # the kernel table found no batch size where it wins
        self.mode = quant
        self.dense_above = dense_above
        self._kernels = kernels if quant is not Quantization.NONE else None
        # Larger batches run the GEMM over the *dequantized* weight, not the original: the layer
        # is one function whatever the batch size, so a request's greedy output does not depend
        # on who else is in the step (only the summation order differs between the two kernels).
        # When the native kernel takes every batch, no dense copy is kept beside the packed one.
        keep_dense = self._kernels is None or dense_above < EVERY_BATCH
        self.dense: torch.Tensor | None = None
        self._packed: list[torch.Tensor] = []
        if quant is Quantization.NONE:
            self.dense = weight.to(dtype).contiguous()
        elif quant is Quantization.INT8:
            q, scale = quantize_int8(weight)
            if keep_dense:
                self.dense = dequantize_int8(q, scale).to(dtype).contiguous()
            if kernels is not None:
                self.q, self.scale = q.contiguous(), scale.float().contiguous()
                self._packed = [self.q, self.scale]
        elif quant is Quantization.INT4:
            q, scale, lo = quantize_int4(weight)
            if keep_dense:
                self.dense = dequantize_int4(q, scale, lo).to(dtype).contiguous()
            if kernels is not None:
                self.packed = pack_int4(q)
                self.scale_lo = torch.stack([scale, lo], dim=-1).float().contiguous()
                self._packed = [self.packed, self.scale_lo]

    def _pad_target(self, rows: int) -> int:
        if not self.padded_rows:
            return rows
        timed = timing.bucket(self._pad_ladder, rows)
        target = self.padded_rows[timed]
        # Past the ladder the largest count is its own target: the batch runs as it is.
        return target if target > timed else rows

    def tensors(self) -> list[torch.Tensor]:
        """What this layer holds in memory: the packed form and any dense copy."""
        return self._packed + [t for t in (self.dense, self.bias) if t is not None]

    def decode_tensors(self) -> list[torch.Tensor]:
        """What a decode batch (a few rows) reads: the packed form where a native kernel runs."""
        if self._kernels is not None and self._packed:
            return self._packed + ([self.bias] if self.bias is not None else [])
        return self.tensors()

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self._kernels is None or x.shape[0] > self.dense_above:
            assert self.dense is not None  # kept whenever some batch takes the GEMM
            rows = x.shape[0]
            target = self._pad_target(rows)
            if target > rows:  # zero rows: the real rows' math is the same, only faster
                return F.linear(torch.cat([x, x.new_zeros(target - rows, x.shape[1])]), self.dense, self.bias)[:rows]
            return F.linear(x, self.dense, self.bias)
        if self.mode is Quantization.INT8:
            out = self._kernels.int8_linear(x, self.q, self.scale)
        else:
            out = self._kernels.int4_linear(x, self.packed, self.scale_lo)
        return out if self.bias is None else out + self.bias
