"""Every attention backend the measured plan can pick computes the same attention as a float64
reference (decode, prefill from 0, extend over cached context; 64- and 128-wide heads; GQA; fp32
and bf16), and the plan runs the measured winner per kind and length, keeping the preferred
backend on a tie."""
from __future__ import annotations

import functools

import pytest
import torch

from segue.model import attention_table as at
from segue.model import table_cache
from segue.model.attention_backends import (
    AttentionBackend,
    AttentionKind,
    lse_merge_available,
    sdpa_decode,
    sdpa_extend_lse,
    sdpa_extend_masked,
    sdpa_prefill,
)
from segue.model.config import ModelConfig
from segue.model.cpu_kernels import load_cpu_kernels

KERNELS = load_cpu_kernels()
CPU = torch.device("cpu")
BS = 16
TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 2e-2}
# (heads, kv heads, head size): the default model's, Qwen2.5-1.5B's, Llama-3-8B's, an MHA one.
LAYOUTS = [(9, 3, 64), (12, 2, 128), (32, 8, 128), (4, 4, 64)]


def make_cache(kvh: int, hd: int, tokens: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    blocks = -(-tokens // BS) + 3
    kc = torch.randn(kvh, blocks, BS, hd, generator=g).to(dtype)
    vc = torch.randn(kvh, blocks, BS, hd, generator=g).to(dtype)
    table = torch.randperm(blocks, generator=g)[:-(-tokens // BS)]  # shuffled, as a busy pool's
    return kc, vc, table


def reference(q, kc, vc, table, start_pos):
    """Causal by absolute position over the context gathered through `table`, in float64."""
    n, nh, hd = q.shape
    kvh, group, ctx = kc.shape[0], nh // kc.shape[0], start_pos + q.shape[0]
    k = kc.double()[:, table].reshape(kvh, -1, hd)[:, :ctx].repeat_interleave(group, 0)
    v = vc.double()[:, table].reshape(kvh, -1, hd)[:, :ctx].repeat_interleave(group, 0)
    scores = q.double().transpose(0, 1) @ k.transpose(1, 2) * hd ** -0.5
    visible = torch.arange(ctx)[None, :] <= torch.arange(start_pos, ctx)[:, None]
    out = scores.masked_fill(~visible, float("-inf")).softmax(-1) @ v
    return out.transpose(0, 1).reshape(n, nh * hd)


def chunk(nh, kvh, hd, n, start_pos, dtype, seed=1):
    """A chunk's queries and its own K/V, written into a cache that already holds its prefix."""
    kc, vc, table = make_cache(kvh, hd, start_pos + n, dtype, seed)
    g = torch.Generator().manual_seed(seed + 1)
    q = torch.randn(n, nh, hd, generator=g).to(dtype)
    slots = [int(table[p // BS]) * BS + p % BS for p in range(start_pos, start_pos + n)]
    k_new = kc.view(kvh, -1, hd)[:, slots].transpose(0, 1).contiguous()
    v_new = vc.view(kvh, -1, hd)[:, slots].transpose(0, 1).contiguous()
    return q, k_new, v_new, kc, vc, table


def padded_tables(lens: list[int], num_blocks: int, seed: int) -> list[list[int]]:
    """Block tables of sequences of these lengths over shuffled cache blocks, padded with block 0
    to the longest (as the executor pads a decode batch's tables)."""
    max_blocks = -(-max(lens) // BS)
    perm = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed))
    tables, used = [], 0
    for n in lens:
        own = -(-n // BS)
        tables.append(perm[used:used + own].tolist() + [0] * (max_blocks - own))
        used += own
    return tables


DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
HEADS = pytest.mark.parametrize("nh,kvh,hd", LAYOUTS, ids=[f"{a}q{b}kv{c}" for a, b, c in LAYOUTS])


@DTYPES
@HEADS
@pytest.mark.parametrize("n,start_pos", [(37, 0), (1, 0), (50, 0)])
def test_prefill_from_position_0(nh, kvh, hd, n, start_pos, dtype):
    q, k_new, v_new, kc, vc, table = chunk(nh, kvh, hd, n, start_pos, dtype)
    out = sdpa_prefill(q, k_new, v_new, hd ** -0.5)
    assert (out.double() - reference(q, kc, vc, table, 0)).abs().max() < TOLERANCE[dtype]


@DTYPES
@HEADS
@pytest.mark.parametrize("backend", [AttentionBackend.SDPA, AttentionBackend.SDPA_MASK])
@pytest.mark.parametrize("n,start_pos", [(40, 300), (1, 77), (16, 16), (130, 31)])
def test_extend_over_cached_context(nh, kvh, hd, n, start_pos, dtype, backend):
    if backend is AttentionBackend.SDPA and not lse_merge_available(CPU):
        pytest.skip("this torch has no CPU flash kernel returning its log-sum-exp")
    q, k_new, v_new, kc, vc, table = chunk(nh, kvh, hd, n, start_pos, dtype)
    if backend is AttentionBackend.SDPA:
        out = sdpa_extend_lse(q, k_new, v_new, kc, vc, table, start_pos, hd ** -0.5)
    else:
        out = sdpa_extend_masked(q, kc, vc, table, start_pos, hd ** -0.5)
    assert (out.double() - reference(q, kc, vc, table, start_pos)).abs().max() < TOLERANCE[dtype]


@DTYPES
@HEADS
def test_decode_batch_with_padded_tables(nh, kvh, hd, dtype):
    lens = [1, 37, 200]
    max_blocks = -(-max(lens) // BS)
    kc, vc, _ = make_cache(kvh, hd, sum(lens) + 3 * BS, dtype)
    tables = padded_tables(lens, kc.shape[1], seed=3)
    q = torch.randn(len(lens), nh, hd, generator=torch.Generator().manual_seed(4)).to(dtype)
    ctx = torch.tensor(lens)
    blocks = torch.tensor(tables).view(-1)
    mask = (torch.arange(max_blocks * BS)[None, :] < ctx[:, None]).view(len(lens), 1, 1, -1)
    outs = {AttentionBackend.SDPA: sdpa_decode(q, kc, vc, blocks, mask, hd ** -0.5)}
    if KERNELS is not None:
        outs[AttentionBackend.NATIVE] = KERNELS.paged_decode_attention(
            q, kc, vc, blocks.view(len(lens), -1), ctx, hd ** -0.5).reshape(len(lens), -1)
    for i, n in enumerate(lens):
        ref = reference(q[i:i + 1], kc, vc, torch.tensor(tables[i][:-(-n // BS)]), n - 1)
        for backend, out in outs.items():
            assert (out[i].double() - ref[0]).abs().max() < TOLERANCE[dtype], backend


@pytest.mark.skipif(KERNELS is None, reason="native kernels unavailable (no compiler)")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
@HEADS
@pytest.mark.parametrize("lens", [[1900], [700, 3]], ids=["one", "long+short"])
def test_decode_of_few_sequences_splits_long_contexts_and_merges_the_parts(nh, kvh, hd, dtype, lens):
    """Fewer (sequence, KV head) items than two per thread: each long context is cut into parts
    whose partial softmaxes are merged, and the result is the same attention; in batch-invariant
    (logical order) runs nothing is split."""
    threads = torch.get_num_threads()
    torch.set_num_threads(max(4, threads))   # parts need idle threads to be asked for
    try:
        kc, vc, _ = make_cache(kvh, hd, sum(lens) + 2 * BS, dtype, seed=5)
        tables = padded_tables(lens, kc.shape[1], seed=6)
        q = torch.randn(len(lens), nh, hd, generator=torch.Generator().manual_seed(7)).to(dtype)
        for logical in (False, True):
            out = KERNELS.paged_decode_attention(q, kc, vc, torch.tensor(tables), torch.tensor(lens), hd ** -0.5,
                                                 logical).reshape(len(lens), -1)
            for i, n in enumerate(lens):
                ref = reference(q[i:i + 1], kc, vc, torch.tensor(tables[i][:-(-n // BS)]), n - 1)
                assert (out[i].double() - ref[0]).abs().max() < TOLERANCE.get(dtype, 2e-3), (logical, i)
    finally:
        torch.set_num_threads(threads)


def layout(nh=9, kvh=3, hd=64, dtype=torch.bfloat16) -> at.HeadLayout:
    return at.HeadLayout(nh, kvh, hd, dtype, dtype)


def test_candidates_follow_what_is_correct_here():
    assert at.candidates(AttentionKind.DECODE, layout(), None, CPU) == (AttentionBackend.SDPA,)
    assert at.candidates(AttentionKind.EXTEND, layout(), None, torch.device("cuda")) == \
        (AttentionBackend.SDPA_MASK,)
    if KERNELS is None:
        return
    assert at.candidates(AttentionKind.PREFILL, layout(), KERNELS, CPU)[0] is AttentionBackend.NATIVE
    # A head size the native prefill kernel lacks, and a GQA group wider than its tile.
    assert AttentionBackend.NATIVE not in at.candidates(AttentionKind.EXTEND, layout(hd=80), KERNELS, CPU)
    assert AttentionBackend.NATIVE not in at.candidates(AttentionKind.PREFILL, layout(96, 1), KERNELS, CPU)


def table(timings: dict) -> at.AttentionTable:
    return at.AttentionTable({}, timings)


def test_plan_runs_the_measured_winner_per_kind_and_length():
    t = table({"decode": {"native": {"256": 1.0, "1024": 3.0, "4096": 9.0},
                          "sdpa": {"256": 2.0, "1024": 2.0, "4096": 8.9}},
               "prefill": {"native": {"32": 0.1, "256": 1.0, "1024": 9.0, "2048": 30.0},
                           "sdpa": {"32": 0.3, "256": 0.5, "1024": 4.0, "2048": 12.0}},
               "extend": {"native": {"16/512": 1.0, "16/4096": 5.0, "128/512": 3.0, "128/4096": 9.0,
                                     "512/512": 9.0, "512/4096": 30.0},
                          "sdpa": {"16/512": 1.5, "16/4096": 6.0, "128/512": 2.0, "128/4096": 5.0,
                                   "512/512": 6.0, "512/4096": 12.0},
                          "sdpa-mask": {"16/512": 3.0, "16/4096": 9.0, "128/512": 4.0, "128/4096": 12.0,
                                        "512/512": 8.0, "512/4096": 40.0}}})
    defaults = {k: AttentionBackend.NATIVE for k in AttentionKind}
    plan = at.AttentionPlan(defaults, t.winners())
    assert plan.backend(AttentionKind.DECODE, 1, 200) is AttentionBackend.NATIVE
    assert plan.backend(AttentionKind.DECODE, 1, 900) is AttentionBackend.SDPA
    # 8.9 against 9.0 is within the margin: the preferred backend stays.
    assert plan.backend(AttentionKind.DECODE, 1, 100_000) is AttentionBackend.NATIVE
    assert plan.backend(AttentionKind.PREFILL, 20, 0) is AttentionBackend.NATIVE
    assert plan.backend(AttentionKind.PREFILL, 2048, 0) is AttentionBackend.SDPA
    assert plan.backend(AttentionKind.EXTEND, 400, 3000) is AttentionBackend.SDPA
    assert plan.backend(AttentionKind.EXTEND, 8, 100) is AttentionBackend.NATIVE


def test_a_forced_backend_runs_only_where_it_is_correct():
    cfg = ModelConfig(vocab_size=100, hidden_size=64 * 9, intermediate_size=64, num_layers=1, num_heads=9,
                      num_kv_heads=3, head_dim=64, max_position_embeddings=128)
    plan = at.plan_attention(cfg, torch.float32, torch.float32, CPU, None, "sdpa-mask")
    assert plan.backend(AttentionKind.EXTEND, 10, 10) is AttentionBackend.SDPA_MASK
    assert plan.backend(AttentionKind.DECODE, 1, 10) is AttentionBackend.SDPA  # no mask form for decodes


def test_measured_once_and_reused_at_later_starts_noisy_or_not(tmp_path, monkeypatch):
    monkeypatch.setenv("SEGUE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(at, "DECODE_CONTEXTS", (64,))
    monkeypatch.setattr(at, "PREFILL_TOKENS", (16,))
    monkeypatch.setattr(at, "EXTEND_TOKENS", (8,))
    monkeypatch.setattr(at, "EXTEND_CACHED", (32,))
    table_cache.clear_memo()
    measured = []
    real = at.measure

    def counting(*args, noisy=False):
        measured.append(args)
        t = real(*args)
        t.noisy = noisy
        return t

    small = layout(4, 2, 16, torch.float32)
    monkeypatch.setattr(at, "measure", functools.partial(counting, noisy=True))
    first = at.attention_table(small, KERNELS, CPU)
    assert first.noisy and set(first.timings_ms) == {"decode", "prefill", "extend"}
    assert set(first.ratios) == {"decode", "prefill", "extend"}
    assert at.attention_table(small, KERNELS, CPU) is first and len(measured) == 1   # this process's
    table_cache.clear_memo()
    again = at.attention_table(small, KERNELS, CPU)   # the next start: from the cache
    assert len(measured) == 1 and again.timings_ms == first.timings_ms and again.winners() == first.winners()
    table_cache.clear_memo()
    at.attention_table(small, KERNELS, CPU, remeasure=True)
    assert len(measured) == 2
    table_cache.clear_memo()


@pytest.mark.skipif(KERNELS is None, reason="no native kernels (no compiler)")
def test_decode_is_timed_on_a_mixed_batch_padded_as_the_executor_pads_it(monkeypatch):
    """The SDPA decode path pads every sequence to the batch's longest; timing a batch of equal
    lengths (as the table once did) showed SDPA its best case only. Both backends now run the
    same mixed batch, whose longest is the ladder point, and compute the same attention on it."""
    monkeypatch.setattr(at, "DECODE_CONTEXTS", (256,))
    monkeypatch.setattr(at, "PREFILL_TOKENS", (16,))
    monkeypatch.setattr(at, "EXTEND_TOKENS", (8,))
    monkeypatch.setattr(at, "EXTEND_CACHED", (32,))
    seen: dict[str, tuple] = {}

    def spy(name, real):
        def call(*args):
            seen[name] = args
            return real(*args)
        return call

    monkeypatch.setattr(at, "sdpa_decode", spy("sdpa", sdpa_decode))
    monkeypatch.setattr(KERNELS, "paged_decode_attention", spy("native", KERNELS.paged_decode_attention))
    small = layout(4, 2, 64, torch.float32)
    at.measure(small, KERNELS, CPU, {"test": "mixed"})
    q, kc, vc, blocks, mask, scale = seen["sdpa"]
    lens = mask.flatten(1).sum(1).tolist()
    assert max(lens) == 256 and len(set(lens)) == at.DECODE_BATCH   # mixed, the longest at the point
    _, _, _, native_blocks, native_lens, _ = seen["native"]
    assert native_lens.tolist() == lens and torch.equal(native_blocks.flatten(), blocks)
    native = KERNELS.paged_decode_attention(q, kc, vc, native_blocks, native_lens, scale).reshape(len(lens), -1)
    torch.testing.assert_close(native, sdpa_decode(q, kc, vc, blocks, mask, scale), atol=2e-5, rtol=1e-4)
