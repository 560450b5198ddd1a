"""Quantize float32 numpy arrays into GGUF (ggml) block formats, so Segue can write llama.cpp checkpoints.

The gguf package quantizes the legacy formats (Q4_0 ... Q8_0) but only dequantizes the K-quants; this
module adds vectorized encoders for Q4_K, Q5_K and Q6_K. The byte layouts are the ones the gguf package's
dequantizers (gguf/quants.py) and ggml-quants.c read. The scheme is simple, not llama.cpp's search for
the error-minimizing scale: per sub-block min/max -> scale (and min), the 6/8-bit sub-block scales are
rounded *up* against the super-block's fp16 d (and dmin), and the codes are re-derived from the rounded
scales. Rounding up means the quantized range always covers the sub-block, so no value is clipped and
each weight is off by at most half a step. Values beyond fp16's range (|w| > ~1e6) are not supported.

Every encoder takes an array [..., K] (K a multiple of the block size) and returns uint8 [..., K /
block_size * type_size]: the raw layout `gguf.GGUFWriter.add_tensor(name, raw, raw_dtype=qtype)` takes.
"""
from __future__ import annotations

from collections.abc import Callable

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import quantize as _gguf_quantize

QK_K = 256
# Rows are encoded this many weights at a time: the intermediates are ~10 arrays of this size, so memory
# stays around 100 MB whatever the tensor.
_CHUNK_WEIGHTS = 1 << 21
_FP16_MAX = float(np.finfo(np.float16).max)

BlockEncoder = Callable[[np.ndarray], np.ndarray]


def _fp16_at_least(v: np.ndarray) -> np.ndarray:
    """float16 values no smaller than v (v >= 0): a super-block scale that never shrinks the range."""
    v = np.minimum(v, _FP16_MAX).astype(np.float32)
    h = v.astype(np.float16)
    # Round-to-nearest may land one ulp below; step up so codes computed against h never overflow.
    return np.where(h.astype(np.float32) < v, np.nextafter(h, np.float16(np.inf)), h)


def _reciprocal(x: np.ndarray) -> np.ndarray:
    """1/x, with 0 where x is 0 (an all-zero sub-block: every code is then 0)."""
    safe = np.where(x > 0, x, 1.0).astype(np.float32)
    return np.where(x > 0, 1.0 / safe, 0.0).astype(np.float32)


def _fp16_bytes(h: np.ndarray) -> np.ndarray:
    """[nb] float16 -> [nb, 2] little-endian bytes."""
    return np.ascontiguousarray(h.astype("<f2")).view(np.uint8).reshape(-1, 2)


def _affine_k(blocks: np.ndarray, levels: int) -> tuple[np.ndarray, ...]:
    """Q4_K/Q5_K's w = d*sc*q - dmin*m over 8 sub-blocks of 32: returns d, dmin (fp16), sc, m, q (uint8)."""
    x = blocks.reshape(-1, 8, 32)
    # As in ggml, the offset is never positive (min clamped to 0), so m is a 6-bit unsigned count.
    mins = -np.minimum(x.min(axis=-1), 0.0)
    dmin = _fp16_at_least(mins.max(axis=-1) / 63)
    dmin32 = dmin.astype(np.float32)[:, None]
    m = np.clip(np.ceil(mins * _reciprocal(dmin32)), 0, 63)
    offset = dmin32 * m  # >= each sub-block's -min: the lowest code reaches below every weight
    # The scale must span [-offset, max] with the offset as quantized, hence computed after m.
    need = (x.max(axis=-1) + offset) / levels
    d = _fp16_at_least(need.max(axis=-1) / 63)
    sc = np.clip(np.ceil(need * _reciprocal(d.astype(np.float32)[:, None])), 0, 63)
    step = d.astype(np.float32)[:, None] * sc
    q = np.rint((x + offset[..., None]) * _reciprocal(step)[..., None])
    q = np.clip(q, 0, levels).astype(np.uint8)
    return d, dmin, sc.astype(np.uint8), m.astype(np.uint8), q


def _pack_scales_k4(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    """Eight 6-bit scales and mins into 12 bytes, the inverse of ggml's get_scale_min_k4.

    Bytes 0-3: sc[0:4] low 6 bits, top 2 bits = sc[4:8] >> 4; bytes 4-7: the same for m;
    bytes 8-11: sc[4:8] low nibble | m[4:8] low nibble << 4.
    """
    out = np.empty((sc.shape[0], 12), dtype=np.uint8)
    out[:, 0:4] = (sc[:, :4] & 63) | ((sc[:, 4:] >> 4) << 6)
    out[:, 4:8] = (m[:, :4] & 63) | ((m[:, 4:] >> 4) << 6)
    out[:, 8:12] = (sc[:, 4:] & 15) | ((m[:, 4:] & 15) << 4)
    return out


def _pack_nibbles_k(q: np.ndarray) -> np.ndarray:
    """[nb, 8, 32] codes -> 128 bytes: per 64-weight chunk i, sub-block 2i in low nibbles, 2i+1 in high."""
    lo = (q & 15).reshape(-1, 4, 2, 32)
    return (lo[:, :, 0] | (lo[:, :, 1] << 4)).reshape(-1, 128)


def q4_k_blocks(blocks: np.ndarray) -> np.ndarray:
    """[nb, 256] float32 -> [nb, 144] block_q4_K {fp16 d; fp16 dmin; u8 scales[12]; u8 qs[128]}."""
    d, dmin, sc, m, q = _affine_k(blocks, 15)
    return np.concatenate([_fp16_bytes(d), _fp16_bytes(dmin), _pack_scales_k4(sc, m), _pack_nibbles_k(q)], axis=1)


def q5_k_blocks(blocks: np.ndarray) -> np.ndarray:
    """[nb, 256] -> [nb, 176] block_q5_K {fp16 d; fp16 dmin; u8 scales[12]; u8 qh[32]; u8 qs[128]}."""
    d, dmin, sc, m, q = _affine_k(blocks, 31)
    # qh byte l holds bit 4 of weight l of sub-block j in its bit j.
    shifts = np.arange(8, dtype=np.uint8)[None, :, None]
    qh = np.bitwise_or.reduce(((q >> 4) & 1) << shifts, axis=1)
    return np.concatenate(
        [_fp16_bytes(d), _fp16_bytes(dmin), _pack_scales_k4(sc, m), qh, _pack_nibbles_k(q)], axis=1
    )


def q6_k_blocks(blocks: np.ndarray) -> np.ndarray:
    """[nb, 256] -> [nb, 210] block_q6_K {u8 ql[128]; u8 qh[64]; i8 scales[16]; fp16 d}; w = d*sc*q."""
    x = blocks.reshape(-1, 16, 16)
    # As in ggml, the largest-magnitude weight maps to code -32 (the asymmetric range's long end).
    extreme = np.take_along_axis(x, np.abs(x).argmax(axis=-1)[..., None], axis=-1)[..., 0]
    want = extreme / -32
    d = _fp16_at_least(np.abs(want).max(axis=-1) / 127)
    d32 = d.astype(np.float32)[:, None]
    sc = np.sign(want) * np.clip(np.ceil(np.abs(want) * _reciprocal(d32)), 0, 127)
    step = d32 * sc
    safe_step = np.where(step != 0, step, 1.0)
    q = np.where(step[..., None] != 0, np.rint(x / safe_step[..., None]), 0.0)
    q6 = (np.clip(q, -32, 31) + 32).astype(np.uint8).reshape(-1, 256)
    # ql: per 128-weight half, byte l's low nibble is weight l, its high nibble weight l + 64.
    lo = (q6 & 15).reshape(-1, 2, 2, 64)
    ql = (lo[:, :, 0] | (lo[:, :, 1] << 4)).reshape(-1, 128)
    # qh: per half, byte l's bit pairs (0-1, 2-3, 4-5, 6-7) are weights l, l + 32, l + 64, l + 96.
    hi = (q6 >> 4).reshape(-1, 2, 4, 32)
    qh = (hi[:, :, 0] | (hi[:, :, 1] << 2) | (hi[:, :, 2] << 4) | (hi[:, :, 3] << 6)).reshape(-1, 64)
    scales = sc.astype(np.int8).view(np.uint8)
    return np.concatenate([ql, qh, scales, _fp16_bytes(d)], axis=1)


_K_ENCODERS: dict[GGMLQuantizationType, BlockEncoder] = {
    GGMLQuantizationType.Q4_K: q4_k_blocks,
    GGMLQuantizationType.Q5_K: q5_k_blocks,
    GGMLQuantizationType.Q6_K: q6_k_blocks,
}
_GGUF_ENCODED = {
    GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q5_0,
    GGMLQuantizationType.Q5_1, GGMLQuantizationType.Q8_0,
}


def _encode_rows(arr: np.ndarray, qtype: GGMLQuantizationType, blocks_fn: BlockEncoder) -> np.ndarray:
    """Apply a [nb, block] -> [nb, type_size] encoder over row chunks of a [..., K] array."""
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    k = arr.shape[-1]
    if arr.ndim == 0 or k % block_size:
        raise ValueError(f"{qtype.name} needs a last dimension that is a multiple of {block_size}, got {arr.shape}")
    rows = arr.reshape(-1, k)
    out = np.empty((rows.shape[0], k // block_size * type_size), dtype=np.uint8)
    step = max(1, _CHUNK_WEIGHTS // k)
    for start in range(0, rows.shape[0], step):
        chunk = np.asarray(rows[start:start + step], dtype=np.float32)
        out[start:start + step] = blocks_fn(chunk.reshape(-1, block_size)).reshape(chunk.shape[0], -1)
    return out.reshape(*arr.shape[:-1], out.shape[-1])


def quantize_q4_k(arr: np.ndarray) -> np.ndarray:
    return _encode_rows(arr, GGMLQuantizationType.Q4_K, q4_k_blocks)


def quantize_q5_k(arr: np.ndarray) -> np.ndarray:
    return _encode_rows(arr, GGMLQuantizationType.Q5_K, q5_k_blocks)


def quantize_q6_k(arr: np.ndarray) -> np.ndarray:
    return _encode_rows(arr, GGMLQuantizationType.Q6_K, q6_k_blocks)


def encode(arr: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    """`arr` [..., K] in `qtype`'s raw bytes, uint8 [..., K / block_size * type_size].

    F32 and F16 come back as their bytes too, so a writer can pass every tensor with raw_dtype=qtype.
    """
    qtype = GGMLQuantizationType(qtype)
    if qtype in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
        dtype = np.float32 if qtype == GGMLQuantizationType.F32 else np.float16
        values = np.ascontiguousarray(arr, dtype=np.dtype(dtype).newbyteorder("<"))
        return values.view(np.uint8).reshape(*arr.shape[:-1], -1)
    blocks_fn = _K_ENCODERS.get(qtype)
    if blocks_fn is not None:
        return _encode_rows(arr, qtype, blocks_fn)
    if qtype in _GGUF_ENCODED:
        # gguf's own (bit-exact with ggml's reference) encoders; chunked here only to bound memory.
        block_size = GGML_QUANT_SIZES[qtype][0]
        return _encode_rows(arr, qtype, lambda b: _gguf_quantize(b.reshape(-1, block_size), qtype))
    raise NotImplementedError(f"no encoder for GGUF type {qtype.name}")
