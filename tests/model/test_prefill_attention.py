"""The native paged prefill attention kernel against a float64 reference: chunks that start at 0
or continue cached context, partial blocks, contexts not a multiple of the key tile, several
sequences per call, GQA, fp32 / bf16 caches, strided queries, head sizes 64 and 128; wrong calls
raise, and paged_prefill_supports agrees with what raises."""
from __future__ import annotations

import pytest
import torch

from segue.model.cpu_kernels import load_cpu_kernels

KERNELS = load_cpu_kernels()
pytestmark = pytest.mark.skipif(KERNELS is None, reason="native CPU kernels unavailable")

HD = 64  # the decode kernel's head size
# Llama-3 8B, Qwen2.5 1.5B: 128; the small models: 64.
HEAD_DIMS = pytest.mark.parametrize("hd", [64, 128])


def reference(q, kc, vc, starts, start_pos, tables, scale):
    """Each chunk's context gathered through its block table, causal by absolute position, in float64."""
    kvh, _, bs, hd = kc.shape
    group = q.shape[1] // kvh
    out = torch.empty(q.shape, dtype=torch.float64)
    for i, sp in enumerate(start_pos):
        a, b = starts[i], starts[i + 1]
        ctx = sp + (b - a)
        blocks = tables[i][: (ctx + bs - 1) // bs]
        k = kc.double()[:, blocks].reshape(kvh, -1, hd)[:, :ctx].repeat_interleave(group, 0)
        v = vc.double()[:, blocks].reshape(kvh, -1, hd)[:, :ctx].repeat_interleave(group, 0)
        scores = q[a:b].double().transpose(0, 1) @ k.transpose(1, 2) * scale
        visible = torch.arange(ctx)[None, :] <= torch.arange(sp, ctx)[:, None]
        out[a:b] = (scores.masked_fill(~visible, float("-inf")).softmax(-1) @ v).transpose(0, 1)
    return out


def make_case(lens, start_pos, kv_heads=3, group=3, block_size=16, num_blocks=160, dtype=torch.float32,
              cache_dtype=torch.float32, seed=0, hd=HD):
    g = torch.Generator().manual_seed(seed)
    kc = torch.randn(kv_heads, num_blocks, block_size, hd, generator=g).to(cache_dtype)
    vc = torch.randn(kv_heads, num_blocks, block_size, hd, generator=g).to(cache_dtype)
    need = [(sp + n + block_size - 1) // block_size for n, sp in zip(lens, start_pos, strict=True)]
    perm = torch.randperm(num_blocks, generator=g).tolist()
    assert sum(need) <= num_blocks
    tables, used = [], 0
    for n in need:  # disjoint, shuffled blocks; padding past a table's end must never be read
        tables.append(perm[used:used + n] + [num_blocks + 7] * (max(need) - n))
        used += n
    starts = [0]
    for n in lens:
        starts.append(starts[-1] + n)
    q = torch.randn(starts[-1], kv_heads * group, hd, generator=g).to(dtype)
    return q, kc, vc, starts, list(start_pos), tables


def run(q, kc, vc, starts, start_pos, tables, scale=None):
    # Padding entries point past the cache; the kernel reads only a chunk's own blocks.
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    safe = [[min(b, kc.shape[1] - 1) for b in t] for t in tables]
    return KERNELS.paged_prefill_attention(q, kc, vc, torch.tensor(starts), torch.tensor(start_pos),
                                           torch.tensor(safe), scale), safe


# bf16 models: outputs rounded to bf16 (and, on CPUs with AVX512-BF16, P rounded to bf16 for
# the P.V product); values are O(1).
TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 2e-2}
DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])


def error(out, q, kc, vc, starts, sp, safe):
    return (out.double() - reference(q, kc, vc, starts, sp, safe, q.shape[-1] ** -0.5)).abs().max().item()


@HEAD_DIMS
@DTYPES
@pytest.mark.parametrize("kv_heads,group", [(3, 3), (2, 6)])  # (2, 6): Qwen2.5-1.5B's 12 query heads
@pytest.mark.parametrize("lens,start_pos", [
    ([37], [0]),                      # fresh prompt, partial last block
    ([400], [1000]),                  # next turn over cached context (not a multiple of the tile)
    ([1, 70, 33], [50, 0, 301]),      # varlen: a one-token chunk, a fresh one, a continuation
    ([16, 17], [16, 31]),             # chunk boundaries exactly on and just off a block
])
def test_matches_float64_reference(lens, start_pos, kv_heads, group, dtype, hd):
    q, kc, vc, starts, sp, tables = make_case(lens, start_pos, kv_heads=kv_heads, group=group, dtype=dtype,
                                              cache_dtype=dtype, hd=hd)
    out, safe = run(q, kc, vc, starts, sp, tables)
    assert out.dtype == dtype and out.shape == q.shape
    assert error(out, q, kc, vc, starts, sp, safe) < TOLERANCE[dtype]


@HEAD_DIMS
@DTYPES
@pytest.mark.parametrize("kv_heads,group", [(1, 1), (2, 4), (3, 3), (1, 8), (2, 6)])
def test_gqa_groups(kv_heads, group, dtype, hd):
    q, kc, vc, starts, sp, tables = make_case([45, 20], [77, 5], kv_heads=kv_heads, group=group, dtype=dtype,
                                              cache_dtype=dtype, hd=hd)
    out, safe = run(q, kc, vc, starts, sp, tables)
    assert error(out, q, kc, vc, starts, sp, safe) < TOLERANCE[dtype]


@HEAD_DIMS
def test_fp16_model(hd):
    """fp16 takes the generic tile with 16-bit storage (as bf16 does on CPUs without AVX512-BF16)."""
    q, kc, vc, starts, sp, tables = make_case([70, 1], [130, 9], kv_heads=2, group=6, dtype=torch.float16,
                                              cache_dtype=torch.float16, hd=hd)
    out, safe = run(q, kc, vc, starts, sp, tables)
    assert out.dtype == torch.float16
    assert error(out, q, kc, vc, starts, sp, safe) < 5e-3  # fp16 output rounding of O(1) values


@HEAD_DIMS
@DTYPES
def test_the_largest_supported_group(dtype, hd):
    """A group as large as a tile's rows (one token per tile), and one more that is refused."""
    group = max(g for g in range(1, 129) if KERNELS.paged_prefill_supports(dtype, dtype, hd, g))
    assert group in (48, 64)  # the bf16 tile's rows, or the generic tile's
    q, kc, vc, starts, sp, tables = make_case([5, 3], [40, 0], kv_heads=1, group=group, dtype=dtype,
                                              cache_dtype=dtype, hd=hd)
    out, safe = run(q, kc, vc, starts, sp, tables)
    assert error(out, q, kc, vc, starts, sp, safe) < TOLERANCE[dtype]
    q, kc, vc, starts, sp, tables = make_case([5], [40], kv_heads=1, group=group + 1, dtype=dtype,
                                              cache_dtype=dtype, hd=hd)
    with pytest.raises(RuntimeError, match="query heads per KV head"):
        run(q, kc, vc, starts, sp, tables)


@HEAD_DIMS
@DTYPES
@pytest.mark.parametrize("block_size", [1, 8, 32, 64])
def test_block_sizes(block_size, dtype, hd):
    q, kc, vc, starts, sp, tables = make_case([50], [90], block_size=block_size, num_blocks=200 // block_size + 4,
                                              dtype=dtype, cache_dtype=dtype, hd=hd)
    out, safe = run(q, kc, vc, starts, sp, tables)
    assert error(out, q, kc, vc, starts, sp, safe) < TOLERANCE[dtype]


@HEAD_DIMS
def test_bf16_cache_under_fp32_queries_reads_the_rows_exactly(hd):
    q, kc, vc, starts, sp, tables = make_case([60, 9], [200, 3], cache_dtype=torch.bfloat16, hd=hd)
    out, safe = run(q, kc, vc, starts, sp, tables)
    assert out.dtype == torch.float32
    # The reference sees the same bf16-rounded rows: the only error is fp32 accumulation.
    assert error(out, q, kc, vc, starts, sp, safe) < 2e-5


@HEAD_DIMS
def test_bf16_model(hd):
    q, kc, vc, starts, sp, tables = make_case([60, 9], [200, 3], dtype=torch.bfloat16, cache_dtype=torch.bfloat16,
                                              hd=hd)
    out, safe = run(q, kc, vc, starts, sp, tables)
    assert out.dtype == torch.bfloat16
    assert error(out, q, kc, vc, starts, sp, safe) < TOLERANCE[torch.bfloat16]


@HEAD_DIMS
@DTYPES
def test_strided_queries_as_from_the_fused_qkv_projection(dtype, hd):
    q, kc, vc, starts, sp, tables = make_case([40], [64], dtype=dtype, cache_dtype=dtype, hd=hd)
    qkv = torch.cat([q.flatten(1), torch.randn(q.shape[0], 2 * 3 * hd).to(dtype)], dim=1)  # [T, (9 + 6) * hd]
    view = qkv[:, :q.shape[1] * hd].view(q.shape[0], q.shape[1], hd)
    assert not view.is_contiguous()
    out, _ = run(view, kc, vc, starts, sp, tables)
    assert torch.equal(out, run(q, kc, vc, starts, sp, tables)[0])


@HEAD_DIMS
def test_a_one_token_context_is_the_value_itself(hd):
    q, kc, vc, starts, sp, tables = make_case([1], [0], hd=hd)
    out, safe = run(q, kc, vc, starts, sp, tables)
    v0 = vc[:, safe[0][0], 0]  # [kv_heads, dim]: each query head of a group gets its KV head's row
    assert torch.allclose(out[0], v0.repeat_interleave(3, 0), atol=1e-6)


SUPPORT_DTYPES = [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.float16, torch.float16),
                  (torch.float64, torch.float64), (torch.float32, torch.bfloat16), (torch.bfloat16, torch.float32),
                  (torch.float32, torch.float16), (torch.float16, torch.bfloat16), (torch.int32, torch.int32)]


@pytest.mark.parametrize("q_dtype,cache_dtype", SUPPORT_DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_supports_agrees_with_what_raises(q_dtype, cache_dtype):
    """The engine asks paged_prefill_supports before choosing the kernel: a yes must run, a no
    must be a combination that raises."""
    for hd in (64, 128, 96, 80, 32):
        for group in (1, 6, 8, 48, 49, 64, 65):
            g = torch.Generator().manual_seed(group)
            q = (torch.randn(3, group, hd, generator=g) * 4).to(q_dtype)
            kc = (torch.randn(1, 4, 16, hd, generator=g) * 4).to(cache_dtype)
            vc = (torch.randn(1, 4, 16, hd, generator=g) * 4).to(cache_dtype)
            call = (torch.tensor([0, 2, 3]), torch.tensor([5, 0]), torch.tensor([[0, 1], [2, 3]]), 0.1)
            supported = KERNELS.paged_prefill_supports(q_dtype, cache_dtype, hd, group)
            try:
                out = KERNELS.paged_prefill_attention(q, kc, vc, *call)
            except RuntimeError:
                assert not supported, (q_dtype, cache_dtype, hd, group)
            else:
                assert supported, (q_dtype, cache_dtype, hd, group)
                assert out.dtype == q_dtype and torch.isfinite(out).all()


def test_supports_answers():
    supports = KERNELS.paged_prefill_supports
    for hd in (64, 128):
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            assert supports(dtype, dtype, hd, 1) and supports(dtype, dtype, hd, 6) and supports(dtype, dtype, hd, 48)
            assert not supports(dtype, dtype, hd, 65) and not supports(dtype, dtype, hd, 0)
        assert supports(torch.float32, torch.bfloat16, hd, 8)
        assert supports(q_dtype=torch.float32, cache_dtype=torch.float32, head_dim=hd, group=64)
        assert not supports(torch.bfloat16, torch.float32, hd, 1)
    for hd in (96, 80, 256, 0):
        assert not supports(torch.float32, torch.float32, hd, 1)
        assert not supports(torch.bfloat16, torch.bfloat16, hd, 1)


def test_wrong_calls_raise():
    q, kc, vc, starts, sp, tables = make_case([20], [10])
    args = [torch.tensor(starts), torch.tensor(sp), torch.tensor(tables)]
    with pytest.raises(RuntimeError, match="outside the cache"):
        KERNELS.paged_prefill_attention(q, kc, vc, args[0], args[1], torch.tensor([[10**6, 0]]), 0.125)
    with pytest.raises(RuntimeError, match="blocks"):  # the table is too short for the context
        KERNELS.paged_prefill_attention(q, kc, vc, args[0], torch.tensor([500]), args[2], 0.125)
    with pytest.raises(RuntimeError, match="span"):
        KERNELS.paged_prefill_attention(q, kc, vc, torch.tensor([0, 5]), args[1], args[2], 0.125)
    with pytest.raises(RuntimeError, match="head size"):
        KERNELS.paged_prefill_attention(q[..., :32].contiguous(), kc, vc, *args, 0.125)
    wide = torch.cat([q, q], dim=-1)  # 128-wide queries against a 64-wide cache
    with pytest.raises(RuntimeError, match="head size"):
        KERNELS.paged_prefill_attention(wide, kc, vc, *args, 0.125)
    with pytest.raises(RuntimeError, match="multiple of KV heads"):
        KERNELS.paged_prefill_attention(q[:, :8].contiguous(), kc, vc, *args, 0.125)


def test_decode_and_rope_kernels_reject_wrong_calls():
    """The other kernels that index the cache check their inputs too: a wrong call raises instead
    of reading or writing out of bounds."""
    kvh, nh, bs, blocks = 3, 9, 16, 8
    kc, vc = torch.zeros(kvh, blocks, bs, HD), torch.zeros(kvh, blocks, bs, HD)
    q = torch.randn(2, nh, HD)
    table, ctx = torch.tensor([[0, 1], [2, 3]]), torch.tensor([5, 20])
    KERNELS.paged_decode_attention(q, kc, vc, table, ctx, 0.125)  # the valid call
    with pytest.raises(RuntimeError, match="context length 0"):
        KERNELS.paged_decode_attention(q, kc, vc, table, torch.tensor([0, 20]), 0.125)
    with pytest.raises(RuntimeError, match="outside the cache"):
        KERNELS.paged_decode_attention(q, kc, vc, torch.tensor([[0, 1], [2, 99]]), ctx, 0.125)
    with pytest.raises(RuntimeError, match="needs 3 blocks"):
        KERNELS.paged_decode_attention(q, kc, vc, table, torch.tensor([5, 40]), 0.125)
    with pytest.raises(RuntimeError, match="head size"):
        KERNELS.paged_decode_attention(torch.randn(2, nh, 32), kc, vc, table, ctx, 0.125)
    qkv = torch.randn(3, (nh + 2 * kvh) * HD)
    cos, sin = torch.randn(10, HD // 2), torch.randn(10, HD // 2)
    KERNELS.rope_and_cache(qkv.clone(), torch.tensor([0, 1, 9]), cos, sin, kc, vc, torch.tensor([0, 1, 127]), nh, kvh)
    with pytest.raises(RuntimeError, match="RoPE table"):
        KERNELS.rope_and_cache(qkv.clone(), torch.tensor([0, 1, 10]), cos, sin, kc, vc, torch.tensor([0, 1, 2]),
                               nh, kvh)
    with pytest.raises(RuntimeError, match="outside the cache"):
        KERNELS.rope_and_cache(qkv.clone(), torch.tensor([0, 1, 2]), cos, sin, kc, vc, torch.tensor([0, 1, 128]),
                               nh, kvh)


@pytest.mark.parametrize("order", ["shuffled", "reversed", "consecutive"])
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
def test_decode_kernel_over_any_block_order(order, cache_dtype):
    """The decode kernel visits a sequence's blocks in the order of their ids, not the table's: the
    result must not depend on how the pool laid the table out (partial last blocks included)."""
    lens = [1, 1, 1]
    ctx = [300, 17, 129]
    kvh, group, bs, num_blocks = 3, 3, 16, 64
    g = torch.Generator().manual_seed(3)
    kc = torch.randn(kvh, num_blocks, bs, HD, generator=g).to(cache_dtype)
    vc = torch.randn(kvh, num_blocks, bs, HD, generator=g).to(cache_dtype)
    need = [(c + bs - 1) // bs for c in ctx]
    ids = {"shuffled": torch.randperm(num_blocks, generator=g).tolist(), "reversed": list(range(num_blocks))[::-1],
           "consecutive": list(range(num_blocks))}[order]
    tables, used = [], 0
    for n in need:
        tables.append(ids[used:used + n] + [0] * (max(need) - n))
        used += n
    q = torch.randn(len(lens), kvh * group, HD, generator=g)
    out = KERNELS.paged_decode_attention(q, kc, vc, torch.tensor(tables), torch.tensor(ctx), HD ** -0.5)
    want = reference(q, kc, vc, [0, 1, 2, 3], [c - 1 for c in ctx], tables, HD ** -0.5)
    torch.testing.assert_close(out.double(), want, rtol=1e-4, atol=1e-4)
