"""GGUF weights kept in the file's own block formats, and the layers that compute on them.

A K-quant file (Q4_K_M, Q5_K_M, Q6_K ...) is what people download to run a model on a CPU.
Expanding it to bf16 at load time makes every decoded token read 3-4x the file's bytes, and decode
is bound by those bytes. So the loader keeps each quantized matrix as its raw blocks
(`GGMLBlocks`), and `BlockLinear` runs the native kernels of csrc/gguf_ops.cpp on them: the sums
of the dequantized weights, without a dense copy. Batches too large for a kernel that streams the
weights (prefill chunks) dequantize the layer to the compute dtype for that call and run the
GEMM, or use a dense copy kept beside the blocks where the user allows the memory
(`--weights-memory dense`); which batch sizes go where is measured (segue/model/gguf_table.py).

On CPUs with AVX512-BF16, Q4_0, Q4_1, Q8_0 and Q4_K matrices may instead be repacked at load time
with 16 output rows interleaved (`BlockLayout.ROWS16`, csrc/gguf_rows16.h: the same codes and
scales in the same bytes, Q4_K's unpacked 6-bit scales 3 % more), which a decode kernel reads with
far fewer instructions a weight; the block table measures both layouts and the faster one is used.
"""
from __future__ import annotations

import enum
import threading
from dataclasses import dataclass
from types import ModuleType

import numpy as np
import torch
import torch.nn.functional as F

# ggml_type ids the native kernels read; any other quantized type is dequantized at load time.
NATIVE_TYPES = {2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K"}
# Not ggml types: Q4_0, Q4_1, Q8_0 and Q4_K repacked as groups of 16 interleaved rows (the kernels' ids).
ROWS16_OF = {2: 1002, 3: 1003, 8: 1008, 12: 1012}
ROWS16_GROUP = 16


class BlockLayout(str, enum.Enum):
    """How a block matrix lies in memory for the decode kernels."""
    FILE = "file"      # the file's rows of blocks
    ROWS16 = "rows16"  # Q4_0, Q4_1, Q8_0, Q4_K in groups of 16 interleaved rows (others stay as in the file)


class WeightsMemory(str, enum.Enum):
    """What a GGUF file's quantized matrices cost in memory."""
    PACKED = "packed"  # the file's blocks only: resident weights ~ the file's tensor bytes
    DENSE = "dense"    # plus a dense copy in the compute dtype where the measured table says it pays


@dataclass
class GGMLBlocks:
    """One quantized matrix as the file stores it: `blocks` [N, row_bytes] uint8, row n holding
    the K weights of output channel n in ggml type `qtype`."""
    blocks: torch.Tensor
    qtype: int
    shape: tuple[int, int]

    @property
    def type_name(self) -> str:
        if self.qtype in ROWS16_OF.values():
            source = next(t for t, r in ROWS16_OF.items() if r == self.qtype)
            return f"{NATIVE_TYPES[source]} (rows16)"
        return NATIVE_TYPES[self.qtype]

    @property
    def nbytes(self) -> int:
        return self.blocks.numel()

    def rows(self, index: torch.Tensor) -> GGMLBlocks:
        """These rows, in this order (llama.cpp's Q/K row permutation is undone on blocks too)."""
        if self.qtype in ROWS16_OF.values():
            raise ValueError("rows of a rows16 matrix: select rows before repacking")
        return GGMLBlocks(self.blocks[index].contiguous(), self.qtype, (int(index.numel()), self.shape[1]))

    def dequantize(self, dtype: torch.dtype = torch.float32, kernels: ModuleType | None = None,
                   ids: torch.Tensor | None = None, into: torch.Tensor | None = None) -> torch.Tensor:
        """The dense matrix (or rows `ids` of it), written `into` a buffer when given: the native
        kernel when built, else gguf's own dequantize, which defines the numbers."""
        if kernels is not None:
            empty = torch.empty(0, dtype=torch.int64)
            return kernels.gguf_dequantize(self.blocks, self.qtype, self.shape[1],
                                           empty if ids is None else ids, dtype, into)
        if self.qtype in ROWS16_OF.values():
            raise ValueError("a rows16 matrix is dequantized by the native kernels only")
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        raw = self.blocks if ids is None else self.blocks[ids]
        dense = dequantize(raw.numpy(), GGMLQuantizationType(self.qtype)).reshape(raw.shape[0], self.shape[1])
        out = torch.from_numpy(np.ascontiguousarray(dense, dtype=np.float32)).to(dtype)
        return out if into is None else into.copy_(out)


def rows16_applies(segment: GGMLBlocks, dtype: torch.dtype, kernels: ModuleType | None) -> bool:
    """Whether `segment` can be repacked as rows16: Q4_0, Q4_1, Q8_0 or Q4_K in whole groups of 16 rows,
    bf16 activations, and kernels built for a CPU with AVX512-BF16."""
    return (segment.qtype in ROWS16_OF and segment.shape[0] % ROWS16_GROUP == 0 and dtype == torch.bfloat16
            and kernels is not None and kernels.gguf_rows16_supported())


def in_layout(segment: GGMLBlocks, layout: BlockLayout, dtype: torch.dtype, kernels: ModuleType | None) -> GGMLBlocks:
    """`segment` as `layout` lays it out (unchanged where that layout does not apply to it)."""
    if layout is BlockLayout.ROWS16 and rows16_applies(segment, dtype, kernels):
        assert kernels is not None
        packed = kernels.gguf_interleave_rows(segment.blocks, segment.qtype, segment.shape[1])
        return GGMLBlocks(packed, ROWS16_OF[segment.qtype], segment.shape)
    return segment


def concat_rows(parts: list[GGMLBlocks]) -> list[GGMLBlocks]:
    """Fused projections (q|k|v, gate|up) as row segments; neighbours of one type merge into one."""
    out: list[GGMLBlocks] = []
    for p in parts:
        if out and out[-1].qtype == p.qtype:
            last = out[-1]
            out[-1] = GGMLBlocks(torch.cat([last.blocks, p.blocks]), p.qtype,
                                 (last.shape[0] + p.shape[0], p.shape[1]))
        else:
            out.append(p)
    return out


class BlockLinear:
    """A linear layer over GGUF blocks, called as `lin(x)` with x [M, K] in the compute dtype.

    Batches of at most `block_rows` rows run the native block kernel; larger ones a GEMM over the
    dense weight: the copy kept when `dense` is set, else dequantized for this call alone.
    """

    def __init__(self, segments: list[GGMLBlocks], bias: torch.Tensor | None, dtype: torch.dtype,
                 kernels: ModuleType, block_rows: int, keep_dense: bool = False, fp32_out: bool = False,
                 layout: BlockLayout = BlockLayout.FILE) -> None:
        """`fp32_out`: the block kernel's fp32 sums are returned as they are (an LM head's
        logits: rounded to bf16, nearby logits tie and greedy picks by token id). `layout`: the
        segments are repacked to it where it applies (the file's blocks are then let go)."""
        segments = [in_layout(s, layout, dtype, kernels) for s in segments]
        self.segments = segments
        self.fp32_out = fp32_out
        self.bias = bias
        self.dtype = dtype
        self._kernels = kernels
        self.block_rows = block_rows
        self._blocks = [s.blocks for s in segments]
        self._types = [s.qtype for s in segments]
        self.out_features = sum(s.shape[0] for s in segments)
        self.in_features = segments[0].shape[1]
        self.dense = self.dequantize() if keep_dense else None

    def tensors(self) -> list[torch.Tensor]:
        """What this layer holds in memory: the blocks and any dense copy."""
        return self._blocks + [t for t in (self.dense, self.bias) if t is not None]

    def decode_tensors(self) -> list[torch.Tensor]:
        """What a decode batch reads: the blocks."""
        return self._blocks + ([self.bias] if self.bias is not None else [])

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def dequantize(self, scratch: bool = False) -> torch.Tensor:
        """The dense weight in the compute dtype; with `scratch`, written into this thread's
        reusable buffer (valid until the next such call: a per-call GEMM's operand)."""
        out = _scratch(self.out_features * self.in_features, self.dtype).view(self.out_features, self.in_features) \
            if scratch else torch.empty(self.out_features, self.in_features, dtype=self.dtype)
        row = 0
        for s in self.segments:
            s.dequantize(self.dtype, self._kernels, into=out[row:row + s.shape[0]])
            row += s.shape[0]
        return out

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] <= self.block_rows:
            out = self._kernels.gguf_linear(x, self._blocks, self._types, self.fp32_out)
            if out.dtype != x.dtype and not self.fp32_out:
                out = out.to(x.dtype)
            return out if self.bias is None else out + self.bias
        dense = self.dense if self.dense is not None else self.dequantize(scratch=True)
        return F.linear(x, dense, self.bias)


_scratch_buffers = threading.local()


def _scratch(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A per-thread buffer of at least `numel` elements of `dtype`, grown as needed and reused:
    the largest layer's dense weight, not a fresh allocation (and its page faults) per call."""
    held = getattr(_scratch_buffers, "by_dtype", None)
    if held is None:
        held = _scratch_buffers.by_dtype = {}
    buf = held.get(dtype)
    if buf is None or buf.numel() < numel:
        buf = held[dtype] = torch.empty(numel, dtype=dtype)
    return buf[:numel]


class BlockEmbedding:
    """Token embeddings looked up from blocks: only the rows a step needs are dequantized."""

    def __init__(self, weight: GGMLBlocks, dtype: torch.dtype, kernels: ModuleType | None) -> None:
        self.weight = weight
        self.dtype = dtype
        self._kernels = kernels

    def __getitem__(self, ids: torch.Tensor) -> torch.Tensor:
        return self.weight.dequantize(self.dtype, self._kernels, ids.reshape(-1)).reshape(*ids.shape, -1)

