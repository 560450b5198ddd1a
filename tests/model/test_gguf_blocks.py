"""GGUF files computed on their blocks: every format the native kernels read sums exactly what
gguf's own dequantize defines, through the real loader, with no dense copy kept."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize

from segue.model.cpu_kernels import load_gguf_kernels
from segue.model.gguf_blocks import NATIVE_TYPES, BlockEmbedding, BlockLinear, GGMLBlocks, concat_rows
from segue.model.gguf_encode import encode

KERNELS = load_gguf_kernels()
pytestmark = pytest.mark.skipif(KERNELS is None, reason="GGUF block kernels unavailable (no compiler)")
TYPES = [T(t) for t in NATIVE_TYPES]


def blocks_of(w: np.ndarray, qtype: T) -> GGMLBlocks:
    raw = encode(w.astype(np.float32), qtype)
    return GGMLBlocks(torch.from_numpy(np.ascontiguousarray(raw).reshape(w.shape[0], -1)), int(qtype), w.shape)


def reference(b: GGMLBlocks) -> torch.Tensor:
    return torch.from_numpy(dequantize(b.blocks.numpy(), T(b.qtype)).reshape(b.shape).astype(np.float64))


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("rows", [1, 3, 8, 9, 17])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_block_kernel_sums_the_dequantized_weights(qtype, rows, dtype):
    rng = np.random.default_rng(int(qtype) * 100 + rows)
    # Enough output rows that the kernel runs its parallel loop; K spans two super-blocks.
    w = rng.standard_normal((160, 512)) * rng.uniform(0.01, 1.0, size=(160, 1))
    b = blocks_of(w, qtype)
    x = torch.randn(rows, 512, dtype=torch.float64).to(dtype)
    y = KERNELS.gguf_linear(x, [b.blocks], [b.qtype], True)   # fp32 sums, not rounded to bf16
    ref = x.double() @ reference(b).T   # the activations as given: bf16 ones are exact in fp64
    assert y.dtype == torch.float32
    torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))


@pytest.mark.parametrize("qtype", [t for t in TYPES if t.name[1] != "K" and "_K" not in t.name], ids=lambda t: t.name)
@pytest.mark.parametrize("width", [96, 544])
def test_legacy_rows_that_are_not_whole_groups_of_eight_blocks(qtype, width):
    """32-wide formats gather eight blocks' scales at a time: rows of 3 and 17 blocks end mid-group."""
    w = np.random.default_rng(width).standard_normal((70, width))
    b = blocks_of(w, qtype)
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(2, width).to(dtype)
        ref = x.double() @ reference(b).T
        torch.testing.assert_close(KERNELS.gguf_linear(x, [b.blocks], [b.qtype], True).double(), ref,
                                   rtol=1e-5, atol=1e-5 * float(ref.abs().max()))


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_dequantize_rows_equals_gguf(qtype):
    w = np.random.default_rng(int(qtype)).standard_normal((40, 256))
    b = blocks_of(w, qtype)
    ref = reference(b).float()
    assert torch.equal(b.dequantize(torch.float32, KERNELS), ref)
    ids = torch.tensor([39, 0, 7, 7])
    assert torch.equal(b.dequantize(torch.float32, KERNELS, ids), ref[ids])
    assert torch.equal(b.dequantize(torch.bfloat16, KERNELS, ids), ref[ids].bfloat16())
    # Without the kernels gguf's numpy dequantize stands in, with the same numbers.
    assert torch.equal(b.dequantize(torch.float32, None, ids), ref[ids])
    emb = BlockEmbedding(b, torch.float32, KERNELS)
    assert torch.equal(emb[torch.tensor([[1, 2], [3, 39]])], ref[torch.tensor([[1, 2], [3, 39]])])


def test_fused_projection_of_mixed_types_is_one_call():
    rng = np.random.default_rng(0)
    parts = [blocks_of(rng.standard_normal((n, 256)), t) for n, t in ((64, T.Q4_K), (32, T.Q4_K), (32, T.Q6_K))]
    segments = concat_rows(parts)
    assert [(s.type_name, s.shape[0]) for s in segments] == [("Q4_K", 96), ("Q6_K", 32)]
    bias = torch.randn(128)
    lin = BlockLinear(segments, bias, torch.float32, KERNELS, block_rows=4)
    assert lin.nbytes == sum(p.nbytes for p in parts) + bias.numel() * 4   # no dense copy
    x = torch.randn(6, 256)
    ref = x.double() @ torch.cat([reference(p) for p in parts]).T + bias.double()
    torch.testing.assert_close(lin(x[:4]).double(), ref[:4], rtol=1e-5, atol=1e-4)   # block kernel
    torch.testing.assert_close(lin(x).double(), ref, rtol=1e-5, atol=1e-4)           # dequantized per call
    dense = BlockLinear(segments, bias, torch.float32, KERNELS, block_rows=4, keep_dense=True)
    assert dense.dense is not None and dense.nbytes == lin.nbytes + 128 * 256 * 4


def test_rejects_a_row_of_the_wrong_length():
    b = blocks_of(np.ones((4, 256)), T.Q4_K)
    with pytest.raises(RuntimeError, match="not 144 bytes"):
        KERNELS.gguf_linear(torch.randn(1, 512), [b.blocks], [b.qtype])
    with pytest.raises(RuntimeError, match="out of range"):
        KERNELS.gguf_dequantize(b.blocks, b.qtype, 256, torch.tensor([4]), torch.float32)


@pytest.mark.parametrize("mix", ["q4_k_m", "q5_k_m", "q6_k", "q8_0", "q4_0"])
def test_a_kquant_file_runs_on_its_blocks_with_the_dequantized_logits(tmp_path, mix):
    """Through the real loader and engine: the plan keeps the file's blocks (resident weights
    within 1.15x of the file's tensor bytes) and greedy logits equal those of the same file
    dequantized at load time, within fp32 rounding."""
    from engine_helpers import make_engine
    from segue.bench.bench_model import write_gguf

    path, _ = write_gguf(tmp_path, layers=2, seed=3, mix=mix, hidden=256, intermediate=512)
    blocks = make_engine(path)                        # float32, quantization "auto"
    dense = make_engine(path, quantization="none")
    model = blocks.executor.model
    assert isinstance(model.lm_head, BlockLinear) and isinstance(model.embed_tokens, BlockEmbedding)
    file_bytes = sum(int(t.n_bytes) for t in __import__("gguf").GGUFReader(str(path)).tensors)
    assert model.weight_bytes() <= 1.15 * file_bytes
    ids = torch.tensor([5, 17, 300, 4000, 9])
    for rows in (1, ids.numel()):   # one decode row, and a prefill-sized call of five
        h_b = model.embed_tokens[ids[:rows]]
        h_d = dense.executor.model.embed_tokens[ids[:rows]]
        torch.testing.assert_close(h_b, h_d)
        torch.testing.assert_close(model.lm_head(h_b), dense.executor.model.lm_head(h_d), rtol=1e-5, atol=1e-5)
        for lb, ld in zip(model.layers, dense.executor.model.layers, strict=True):
            for name in ("qkv", "o", "gate_up", "down"):
                a, d = getattr(lb, name), getattr(ld, name)
                x = torch.randn(rows, a.in_features)
                torch.testing.assert_close(a(x), d(x), rtol=1e-5, atol=1e-5)
