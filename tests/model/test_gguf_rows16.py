"""Q4_0, Q4_1, Q8_0 and Q4_K repacked as groups of 16 interleaved rows (csrc/gguf_rows16.h): the same sums as the
file's blocks, the same dequantized weights to the bit, chosen per op by the block table's
timing, and a tied LM head's repacked blocks serve the embedding too (one copy)."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from test_gguf_blocks import blocks_of, reference

from segue.model.cpu_kernels import load_gguf_kernels
from segue.model.gguf_blocks import (
    ROWS16_OF,
    BlockEmbedding,
    BlockLayout,
    BlockLinear,
    concat_rows,
    in_layout,
    rows16_applies,
)
from segue.model.gguf_table import BlockTable

KERNELS = load_gguf_kernels()
pytestmark = pytest.mark.skipif(KERNELS is None or not KERNELS.gguf_rows16_supported(),
                                reason="rows16 needs the GGUF kernels built for a CPU with AVX512-BF16")


FORMATS = [T.Q4_0, T.Q4_1, T.Q8_0, T.Q4_K]


def q4_k(rows: int, k: int, seed: int, qtype: T = T.Q4_K):
    rng = np.random.default_rng(seed)
    return blocks_of(rng.standard_normal((rows, k)) * rng.uniform(0.01, 1.0, size=(rows, 1)), qtype)


@pytest.mark.parametrize("qtype", FORMATS, ids=lambda t: t.name)
@pytest.mark.parametrize("rows", [1, 3, 8, 9, 17])
def test_rows16_kernel_sums_the_dequantized_weights(qtype, rows):
    b = q4_k(160, 512, rows, qtype)
    packed = in_layout(b, BlockLayout.ROWS16, torch.bfloat16, KERNELS)
    assert packed.qtype == ROWS16_OF[int(qtype)] and packed.shape == b.shape
    # 16-row groups: the file's bytes, Q4_K's unpacked 6-bit scales 3 % more.
    assert packed.nbytes <= (1.03 if qtype == T.Q4_K else 1.0) * b.nbytes
    x = torch.randn(rows, 512, dtype=torch.float64).to(torch.bfloat16)
    y = KERNELS.gguf_linear(x, [packed.blocks], [packed.qtype], True)
    ref = x.double() @ reference(b).T
    torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))
    # bf16 out: the fp32 sums rounded once, as the file layout's kernel rounds its own.
    assert torch.equal(KERNELS.gguf_linear(x, [packed.blocks], [packed.qtype]), y.bfloat16())


@pytest.mark.parametrize("qtype", FORMATS, ids=lambda t: t.name)
def test_rows16_dequantizes_to_the_same_bits(qtype):
    b = q4_k(48, 768, 0, qtype)
    packed = in_layout(b, BlockLayout.ROWS16, torch.bfloat16, KERNELS)
    file_layout = b.dequantize(torch.bfloat16, KERNELS)
    assert torch.equal(file_layout, reference(b).float().bfloat16())
    assert torch.equal(packed.dequantize(torch.bfloat16, KERNELS), file_layout)
    ids = torch.tensor([47, 0, 17, 17, 31])
    assert torch.equal(packed.dequantize(torch.bfloat16, KERNELS, ids), file_layout[ids])
    with pytest.raises(ValueError, match="native kernels"):
        packed.dequantize(torch.bfloat16, None)
    with pytest.raises(RuntimeError, match="bf16"):
        packed.dequantize(torch.float32, KERNELS)


def test_only_whole_groups_of_q4_k_under_bf16_are_repacked():
    rng = np.random.default_rng(1)
    assert not rows16_applies(q4_k(40, 256, 2), torch.bfloat16, KERNELS)          # 40 rows: not groups of 16
    assert not rows16_applies(q4_k(32, 256, 2), torch.float32, KERNELS)           # fp32 activations
    for other in (T.Q5_0, T.Q5_K, T.Q6_K):
        assert not rows16_applies(blocks_of(rng.standard_normal((32, 256)), other), torch.bfloat16, KERNELS)
    with pytest.raises(RuntimeError, match="bf16 activations"):
        packed = in_layout(q4_k(32, 256, 3), BlockLayout.ROWS16, torch.bfloat16, KERNELS)
        KERNELS.gguf_linear(torch.randn(1, 256), [packed.blocks], [packed.qtype])


def test_fused_projection_mixes_rows16_and_file_segments():
    """q|k|v as one call: the Q4_K rows repacked, the Q6_K ones as the file has them; threads split
    the call by bytes, whatever the segments' bytes a row."""
    rng = np.random.default_rng(4)
    parts = [q4_k(1024, 512, 5), q4_k(64, 512, 6), blocks_of(rng.standard_normal((64, 512)), T.Q6_K),
             q4_k(48, 512, 7, T.Q4_1), q4_k(16, 512, 8, T.Q4_0)]
    segments = concat_rows(parts)
    bias = torch.randn(1216).bfloat16()
    file_layout = BlockLinear(segments, bias, torch.bfloat16, KERNELS, block_rows=8)
    rows16 = BlockLinear(segments, bias, torch.bfloat16, KERNELS, block_rows=8, layout=BlockLayout.ROWS16)
    assert [s.type_name for s in rows16.segments] == ["Q4_K (rows16)", "Q6_K", "Q4_1 (rows16)", "Q4_0 (rows16)"]
    for rows in (1, 5, 12):   # 12: past block_rows, the GEMM over the dequantized rows16 blocks
        x = torch.randn(rows, 512).bfloat16()
        a, b = rows16(x).float(), file_layout(x).float()
        torch.testing.assert_close(a, b, rtol=1e-2, atol=1e-2 * float(b.abs().max()))
    x = torch.randn(3, 512).bfloat16()
    def sums(lin: BlockLinear) -> torch.Tensor:
        return KERNELS.gguf_linear(x, [s.blocks for s in lin.segments], [s.qtype for s in lin.segments], True)

    exact, got = sums(file_layout), sums(rows16)
    torch.testing.assert_close(got, exact, rtol=1e-5, atol=1e-5 * float(exact.abs().max()))


@pytest.mark.parametrize("head", [T.Q4_K, T.Q8_0], ids=lambda t: t.name)
def test_a_tied_head_repacked_serves_the_embedding(tmp_path, head):
    """Through the loader: a tied head in rows16 (Q4_K, Q8_0) is the embedding's table as well (resident
    weights count it once), and the model's numbers are the file layout's."""
    from segue.bench.bench_model import write_gguf
    from segue.model.linear_plan import LinearPlan
    from segue.model.llama import LlamaModel
    from segue.model.loader import load_checkpoint

    path, _ = write_gguf(tmp_path, layers=1, seed=3, mix="q4_k_m", hidden=256, intermediate=512)
    ckpt = load_checkpoint(path, keep_blocks=True)
    embed = ckpt.weights["model.embed_tokens.weight"]
    ckpt.weights["model.embed_tokens.weight"] = blocks_of(reference(embed).numpy(), head)   # a rows16 tied head
    plans = {layout: LinearPlan(block_rows=8, head_block_rows=8, block_layout=layout, head_block_layout=layout)
             for layout in ("file", "rows16")}
    models = {k: LlamaModel(ckpt.config, ckpt.weights, torch.device("cpu"), torch.bfloat16, p, KERNELS)
              for k, p in plans.items()}
    packed, plain = models["rows16"], models["file"]
    assert isinstance(packed.embed_tokens, BlockEmbedding) and isinstance(packed.lm_head, BlockLinear)
    assert packed.embed_tokens.weight is packed.lm_head.segments[0]
    assert packed.embed_tokens.weight.qtype == ROWS16_OF[int(head)]
    assert packed.weight_bytes() <= 1.03 * plain.weight_bytes()
    ids = torch.tensor([5, 17, 300, 4000])
    h = packed.embed_tokens[ids]
    assert torch.equal(h, plain.embed_tokens[ids])
    torch.testing.assert_close(packed.lm_head(h), plain.lm_head(h), rtol=1e-5, atol=1e-5)
    assert packed.layers[0].gate_up.segments[0].qtype == ROWS16_OF[int(T.Q4_K)]


def test_the_block_table_picks_the_layout_faster_at_one_row():
    def table(rows16_ms: float | None) -> BlockTable:
        layers = {"blocks": {1: 2.0, 2: 2.5}, "dequant": {1: 9.0, 2: 9.0}}
        if rows16_ms is not None:
            layers["rows16"] = {1: rows16_ms, 2: 1.5}
        return BlockTable({}, {"layers": layers})

    assert table(None).layout("layers") is BlockLayout.FILE
    assert table(1.2).layout("layers") is BlockLayout.ROWS16
    assert table(2.0).layout("layers") is BlockLayout.FILE      # no faster: the file's layout stays
    assert table(1.2).block_rows("layers", "dequant") == 2
