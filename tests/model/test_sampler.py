"""Sampler correctness: greedy, filtering, seeded reproducibility, distribution and logprobs."""
from __future__ import annotations

import math

import pytest
import torch

from segue.model.sampler import SampleResult, sample
from segue.sampling_params import SamplingParams

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _logits(batch: int, vocab: int, seed: int = 0, device: str = "cpu", dtype=torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(batch, vocab, generator=g) * 3).to(device=device, dtype=dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_is_argmax(device: str, dtype: torch.dtype) -> None:
    logits = _logits(5, 1000, device=device, dtype=dtype)
    params = [SamplingParams(temperature=0.0) for _ in range(5)]
    out = sample(logits, params, [0] * 5)
    assert all(isinstance(r, SampleResult) for r in out)
    assert [r.token_id for r in out] == logits.float().argmax(-1).tolist()
    assert all(r.logprob is None and r.top is None for r in out)


@pytest.mark.parametrize("device", DEVICES)
def test_greedy_with_logprobs_matches_fast_path(device: str) -> None:
    logits = _logits(4, 500, device=device)
    params = [SamplingParams(temperature=0.0, logprobs=2) for _ in range(4)]
    out = sample(logits, params, [0] * 4)
    assert [r.token_id for r in out] == logits.argmax(-1).tolist()


@pytest.mark.parametrize("device", DEVICES)
def test_top_k_1_equals_greedy(device: str) -> None:
    logits = _logits(8, 2000, seed=1, device=device)
    params = [SamplingParams(temperature=1.5, top_k=1) for _ in range(8)]
    for step in range(5):
        out = sample(logits, params, [step] * 8)
        assert [r.token_id for r in out] == logits.argmax(-1).tolist()


@pytest.mark.parametrize("device", DEVICES)
def test_tiny_top_p_keeps_only_max(device: str) -> None:
    logits = _logits(8, 2000, seed=2, device=device)
    params = [SamplingParams(temperature=1.0, top_p=1e-6) for _ in range(8)]
    out = sample(logits, params, [0] * 8)
    assert [r.token_id for r in out] == logits.argmax(-1).tolist()


@pytest.mark.parametrize("device", DEVICES)
def test_top_k_restricts_support(device: str) -> None:
    logits = _logits(1, 300, seed=3, device=device)
    allowed = set(logits[0].topk(5).indices.tolist())
    params = [SamplingParams(temperature=2.0, top_k=5)]
    seen = {sample(logits, params, [i])[0].token_id for i in range(300)}
    assert seen <= allowed and len(seen) > 1


@pytest.mark.parametrize("device", DEVICES)
def test_seeded_reproducible(device: str) -> None:
    logits = _logits(1, 5000, seed=4, device=device)
    p = [SamplingParams(temperature=1.0, seed=1234)]
    a = [sample(logits, p, [pos])[0].token_id for pos in range(20)]
    b = [sample(logits, p, [pos])[0].token_id for pos in range(20)]
    assert a == b
    # Different positions must not all give the same draw (the position feeds the seed).
    assert len(set(a)) > 1


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("filtering", [{}, {"top_k": 50}, {"top_p": 0.9}, {"top_k": 100, "top_p": 0.8}])
def test_seeded_independent_of_batch(device: str, filtering: dict) -> None:
    vocab = 4000
    row = _logits(1, vocab, seed=5, device=device)
    target = SamplingParams(temperature=0.9, seed=77, **filtering)
    others = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.3, top_k=7),
        SamplingParams(temperature=0.7, top_p=0.5, seed=3),
        SamplingParams(temperature=1.0, logprobs=3),
    ]
    for pos in range(10):
        alone = sample(row, [target], [pos])[0].token_id
        before, after = _logits(2, vocab, seed=10 + pos, device=device), _logits(2, vocab, seed=20, device=device)
        batch = torch.cat([before, row, after])
        params = others[:2] + [target] + others[2:]
        out = sample(batch, params, [5, 9, pos, 1, 0])
        assert out[2].token_id == alone


@pytest.mark.parametrize("device", DEVICES)
def test_temperature_distribution(device: str) -> None:
    # A 4-token vocab sampled many times in one batch; frequencies must follow softmax(l / T).
    base = torch.tensor([1.0, 0.5, 0.0, -1.0])
    n = 40000
    for temp in (1.0, 0.5, 2.0):
        logits = base.repeat(n, 1).to(device)
        out = sample(logits, [SamplingParams(temperature=temp)] * n, [0] * n)
        counts = torch.bincount(torch.tensor([r.token_id for r in out]), minlength=4).double()
        expected = torch.softmax(base.double() / temp, -1) * n
        chi2 = float(((counts - expected) ** 2 / expected).sum())
        # 3 degrees of freedom: P(chi2 > 25) is about 1.6e-5.
        assert chi2 < 25, (temp, counts.tolist(), expected.tolist())


@pytest.mark.parametrize("device", DEVICES)
def test_seeded_distribution(device: str) -> None:
    # Seeded draws across positions must also follow the distribution, not just be repeatable.
    base = torch.tensor([[2.0, 1.0, 0.0, 0.0]], device=device)
    n = 4000
    counts = [0] * 4
    for pos in range(n):
        counts[sample(base, [SamplingParams(seed=42)], [pos])[0].token_id] += 1
    expected = (torch.softmax(base[0].double().cpu(), -1) * n).tolist()
    chi2 = sum((c - e) ** 2 / e for c, e in zip(counts, expected, strict=True))
    assert chi2 < 25, (counts, expected)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_logprobs_are_raw_log_softmax(device: str, dtype: torch.dtype) -> None:
    logits = _logits(3, 700, seed=6, device=device, dtype=dtype)
    ref = logits.float().log_softmax(-1).cpu()
    params = [
        SamplingParams(temperature=0.3, top_k=10, logprobs=5),  # filtering must not affect logprobs
        SamplingParams(temperature=0.0, logprobs=0),
        SamplingParams(temperature=1.0),
    ]
    out = sample(logits, params, [0, 0, 0])
    r0, r1, r2 = out
    assert r0.logprob == pytest.approx(ref[0, r0.token_id].item(), abs=1e-5)
    assert r0.top is not None and len(r0.top) == 5
    want = ref[0].topk(5)
    assert [t for t, _ in r0.top] == want.indices.tolist()
    for (_, lp), w in zip(r0.top, want.values.tolist(), strict=True):
        assert lp == pytest.approx(w, abs=1e-5)
    assert [lp for _, lp in r0.top] == sorted((lp for _, lp in r0.top), reverse=True)
    # logprobs=0: only the chosen token's logprob.
    assert r1.token_id == logits[1].float().argmax().item()
    assert r1.logprob == pytest.approx(ref[1].max().item(), abs=1e-5)
    assert r1.top == []
    assert r2.logprob is None and r2.top is None
    assert all(lp <= 0 for r in (r0, r1) for lp in [r.logprob] + [v for _, v in r.top])
    assert math.isclose(sum(math.exp(v) for v in ref[0].tolist()), 1.0, rel_tol=1e-4)


@pytest.mark.parametrize("device", DEVICES)
def test_mixed_batch(device: str) -> None:
    logits = _logits(6, 1000, seed=7, device=device)
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.0, seed=1),
        SamplingParams(temperature=0.0, logprobs=1),
        SamplingParams(temperature=0.8, top_k=1),
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=1.0, top_p=1e-9, seed=9),
    ]
    out = sample(logits, params, [0, 1, 2, 3, 4, 5])
    am = logits.argmax(-1).tolist()
    assert out[0].token_id == am[0]
    assert out[2].token_id == am[2] and out[2].logprob is not None and len(out[2].top or []) == 1
    assert out[3].token_id == am[3]
    assert out[5].token_id == am[5]
    assert 0 <= out[1].token_id < 1000 and 0 <= out[4].token_id < 1000
    assert out[1].token_id == sample(logits[1:2], [params[1]], [1])[0].token_id


def test_masked_logits_never_sampled() -> None:
    # -inf logits (e.g. from grammar masks) must have zero chance even at high temperature.
    logits = torch.full((2000, 10), float("-inf"))
    logits[:, 3] = 0.0
    logits[:, 7] = 0.0
    out = sample(logits, [SamplingParams(temperature=5.0)] * 2000, [0] * 2000)
    assert {r.token_id for r in out} == {3, 7}


def test_shape_mismatch_and_empty() -> None:
    with pytest.raises(ValueError):
        sample(torch.zeros(2, 5), [SamplingParams()], [0, 0])
    assert sample(torch.zeros(0, 5), [], []) == []


@pytest.mark.parametrize("device", DEVICES)
def test_candidate_filter_equals_full_sort(device: str) -> None:
    # The top-k/top-p shortcut over the most likely tokens must keep exactly the tokens the
    # full sort keeps, for every row it calls exact; rows it cannot settle must say so.
    from segue.model.sampler import _CANDIDATES, _candidate_filter, _filter_top_k_top_p

    vocab = 3000
    x = _logits(8, vocab, seed=3, device=device)
    # Nearly flat row (distinct values, so no ties): a 0.9 nucleus needs ~2,700 tokens.
    x[4] = torch.arange(vocab, device=device) * 1e-5
    for temp, k, p in [(0.2, vocab, 0.9), (1.0, 40, 1.0), (1.0, 40, 0.5), (0.7, vocab, 0.95),
                       (1.0, _CANDIDATES + 10, 0.9), (3.0, vocab, 0.99)]:
        xs = x / temp
        temps = torch.full((8,), temp, device=device)
        ks = torch.full((8,), k, device=device)
        ps = torch.full((8,), p if p < 1.0 else float("inf"), device=device)
        ref = _filter_top_k_top_p(xs, ks, ps)
        vals, ids, exact = _candidate_filter(x, temps, ks, ps)
        if k > _CANDIDATES and k < vocab:
            assert not exact.any()
        assert not bool(exact[4]) or k <= _CANDIDATES
        for r in range(8):
            if not exact[r]:
                continue
            kept_ref = set(torch.nonzero(ref[r] > float("-inf")).flatten().tolist())
            kept = set(ids[r][vals[r] > float("-inf")].tolist())
            assert kept == kept_ref, (temp, k, p, r)


def test_candidate_sampling_follows_nucleus() -> None:
    # Draws through the candidate path follow the renormalized nucleus distribution.
    vocab = 1000
    base = torch.full((vocab,), -20.0)
    base[:3] = torch.tensor([2.0, 1.0, 0.0])
    n = 20000
    params = SamplingParams(temperature=1.0, top_p=0.95)
    out = sample(base.repeat(n, 1), [params] * n, [0] * n)
    counts = torch.bincount(torch.tensor([r.token_id for r in out]), minlength=vocab).double()
    assert counts[3:].sum() == 0
    expected = torch.softmax(base[:3].double(), -1) * n
    chi2 = float(((counts[:3] - expected) ** 2 / expected).sum())
    assert chi2 < 25, (counts[:3].tolist(), expected.tolist())
