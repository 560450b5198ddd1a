"""--batch-invariant is bitwise: a request's logits at every step are the same bits whatever else
the engine runs (other requests in its steps), wherever its KV lives (block ids), however its
prompt is chunked (chunks of one token included) and whether its prefix came from the cache.

Compared as whole logits rows with torch.equal, not as greedy tokens: a token flips only when two
logits are within the difference, which a few dozen tokens rarely show. Two head sizes: 16, which
the native prefill kernel does not take, and 64, which it does (segue/executor/model_executor.py).
"""
from __future__ import annotations

import itertools
import random
from collections import defaultdict
from typing import Any

import pytest
import torch

from conftest import make_tiny_checkpoint
from engine_helpers import make_engine
from segue.engine.engine_request import EngineRequest
from segue.sampling_params import SamplingParams

ROUNDS = 3
MAX_TOKENS = 6
PARAMS = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
TARGET = "target"


class LogitsTap:
    """Records, per request, the logits row of every step that samples it and the chunks it ran as
    (start position, token count, block table)."""

    def __init__(self, engine: Any) -> None:
        ex = engine.executor
        self.logits: dict[str, list[torch.Tensor]] = defaultdict(list)
        self.chunks: dict[str, list[tuple[int, int, list[int]]]] = defaultdict(list)
        self.mismatched = 0
        self._rows: torch.Tensor | None = None
        real_logits, real_execute = ex.model.compute_logits, ex.execute

        def compute_logits(hidden: torch.Tensor) -> torch.Tensor:
            self._rows = real_logits(hidden)
            return self._rows

        def execute(out: Any) -> dict[str, Any]:
            self._rows = None
            sampled = real_execute(out)
            for seq in out.seqs:
                self.chunks[seq.request.request_id].append((seq.start_pos, seq.num_tokens, list(seq.block_table)))
            # The executor lists its sampled tokens in the order of the logits' rows (greedy
            # sampling: each token is its row's argmax, checked in run()).
            for row, (rid, token) in zip(self._rows if sampled else [], sampled.items(), strict=True):
                self.mismatched += int(row.argmax()) != token.token_id
                self.logits[rid].append(row.clone())
            return sampled

        ex.model.compute_logits = compute_logits
        ex.execute = execute


def run(engine: Any, arrivals: list[tuple[int, str, list[int]]]) -> LogitsTap:
    """Adds each (step, request id, prompt) before that step; steps until every request ends."""
    tap = LogitsTap(engine)
    pending = sorted(arrivals, key=lambda a: a[0])
    step = 0
    while pending or engine.has_unfinished_requests():
        while pending and pending[0][0] <= step:
            _, rid, prompt = pending.pop(0)
            engine.add_request(EngineRequest(prompt, PARAMS, rid))
        engine.step()
        step += 1
        assert step < 10_000, "engine made no progress"
    assert tap.mismatched == 0, "sampled tokens are not their logits rows' argmax: the tap misreads the rows"
    return tap


def prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(100, 49_000) for _ in range(n)]


def others(rng: random.Random, count: int, longest: int = 100) -> list[tuple[int, str, list[int]]]:
    """Requests arriving over the first steps, so their prefills meet the target's prefill and decodes."""
    return [(rng.randrange(4), f"other{i}", prompt(rng, rng.randint(1, longest))) for i in range(count)]


def scatter_pool(engine: Any, rng: random.Random) -> None:
    """Fills the pool with random requests, then aborts them in a random order, so the next
    tables are made of blocks freed in that order (ids out of order, with gaps)."""
    ids: list[str] = []
    while engine.scheduler.state.kv.num_free_blocks > 2 and len(ids) < 100:
        ids.append(f"filler{len(ids)}")
        engine.add_request(EngineRequest(prompt(rng, rng.randint(8, 100)),
                                         SamplingParams(temperature=0.0, max_tokens=1_000, ignore_eos=True), ids[-1]))
        engine.step()
    rng.shuffle(ids)
    for rid in ids:
        engine.abort_request(rid)
    assert not engine.has_unfinished_requests()


def assert_same(name: str, ref: LogitsTap, got: LogitsTap) -> None:
    want, have = ref.logits[TARGET], got.logits[TARGET]
    assert len(want) == len(have) == MAX_TOKENS, (name, len(want), len(have))
    for step, (a, b) in enumerate(zip(want, have, strict=True)):
        assert torch.equal(a, b), (f"{name}: logits of token {step} differ by up to "
                                   f"{float((a - b).abs().max()):.3g} (chunks {got.chunks[TARGET][:4]}...)")


@pytest.fixture(scope="module")
def kernels() -> Any:
    from segue.model.cpu_kernels import load_cpu_kernels

    module = load_cpu_kernels()
    if module is None:
        pytest.skip("batch_invariant needs the native CPU kernels")
    return module


@pytest.mark.parametrize("head_dim,heads,kv_heads,dtype,cache_dtype", [
    (64, 4, 4, torch.float32, torch.float32), (64, 8, 2, torch.float32, torch.bfloat16),
    (128, 12, 2, torch.float32, torch.float32), (64, 6, 2, torch.bfloat16, torch.bfloat16)])
def test_a_kernel_row_depends_on_its_own_context_only(kernels: Any, head_dim: int, heads: int, kv_heads: int,
                                                      dtype: torch.dtype, cache_dtype: torch.dtype) -> None:
    """The paged prefill kernel gives a sequence's rows the same bits as one chunk or as chunks of
    any size (1 included) sharing a call with other sequences' chunks, i.e. in other tiles; the
    decode kernel in logical order gives them whatever block ids hold the same KV."""
    gen, rng = torch.Generator().manual_seed(head_dim + heads), random.Random(heads)
    bs, nb, scale = 16, 40, head_dim ** -0.5
    kc, vc = (torch.randn(kv_heads, nb, bs, head_dim, generator=gen).to(cache_dtype) for _ in range(2))
    n = rng.randint(100, 300)
    table = torch.randperm(nb, generator=gen)[:-(-n // bs)]
    q = torch.randn(n, heads, head_dim, generator=gen).to(dtype)
    whole = kernels.paged_prefill_attention(q, kc, vc, torch.tensor([0, n]), torch.tensor([0]), table[None], scale)
    bounds = sorted(set(rng.sample(range(1, n - 3), 12)) | {0, n - 3, n - 2, n - 1, n})
    rows, starts, positions, tables, ours = [], [0], [], [], []
    for a, b in itertools.pairwise(bounds):
        if rng.random() < 0.5:  # another sequence's chunk in the same call
            m = rng.randint(1, 40)
            rows.append(torch.randn(m, heads, head_dim, generator=gen).to(dtype))
            positions.append(rng.randint(0, 64 - m))
            tables.append(torch.randperm(nb, generator=gen)[:4])
            starts.append(starts[-1] + m)
        ours.append(len(positions))
        rows.append(q[a:b])
        positions.append(a)
        tables.append(table)
        starts.append(starts[-1] + b - a)
    width = max(len(t) for t in tables)
    padded = torch.stack([torch.cat([t, t.new_zeros(width - len(t))]) for t in tables])
    out = kernels.paged_prefill_attention(torch.cat(rows), kc, vc, torch.tensor(starts), torch.tensor(positions),
                                          padded, scale)
    assert torch.equal(torch.cat([out[starts[i]:starts[i + 1]] for i in ours]), whole)

    # The same logical KV in other blocks (the layout a loaded pool hands out).
    moved = torch.randperm(nb, generator=gen)[:len(table)]
    kc2, vc2 = kc.clone(), vc.clone()
    kc2[:, moved], vc2[:, moved] = kc[:, table], vc[:, table]
    ctx = torch.tensor([n])
    first = kernels.paged_decode_attention(q[-1:], kc, vc, table[None], ctx, scale, logical_order=True)
    assert torch.equal(kernels.paged_decode_attention(q[-1:], kc2, vc2, moved[None], ctx, scale, logical_order=True),
                       first)


@pytest.fixture(scope="module", params=[16, 64], ids=["head16", "head64"])
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, kernels: Any) -> Any:
    return make_tiny_checkpoint(tmp_path_factory.mktemp(f"bi{request.param}"), seed=3, head_dim=request.param)


@pytest.mark.parametrize("round_", range(ROUNDS))
def test_logits_are_bitwise_the_same_under_any_load(checkpoint: Any, round_: int) -> None:
    rng = random.Random(1000 + round_)
    target = prompt(rng, rng.randint(33, 120))
    ref = run(make_engine(checkpoint, batch_invariant=True), [(0, TARGET, target)])
    assert [c[:2] for c in ref.chunks[TARGET]] == [(0, len(target))] + [(len(target) + i, 1)
                                                                       for i in range(MAX_TOKENS - 1)]

    # Other requests' prefill chunks and decodes in the target's steps.
    batched = run(make_engine(checkpoint, batch_invariant=True),
                  others(rng, 6) + [(rng.randrange(3), TARGET, target)])
    assert_same("batched", ref, batched)

    # The prompt one token per step, then in chunks of another size, both beside other requests.
    singles = run(make_engine(checkpoint, batch_invariant=True, budget=1), [(0, TARGET, target)] + others(rng, 1, 8))
    assert {n for _, n, _ in singles.chunks[TARGET]} == {1}
    assert_same("1-token chunks", ref, singles)
    budget = rng.choice([3, 7, 17, 33])
    chunked = run(make_engine(checkpoint, batch_invariant=True, budget=budget),
                  [(rng.randrange(3), TARGET, target)] + others(rng, 3))
    assert_same(f"chunks of {budget}", ref, chunked)

    # Blocks handed out in the order a random set of requests released them.
    engine = make_engine(checkpoint, batch_invariant=True, kv_tokens=1024)
    scatter_pool(engine, rng)
    scattered = run(engine, [(0, TARGET, target)] + others(rng, 2))
    table = scattered.chunks[TARGET][-1][2]
    assert table != sorted(table) and table != ref.chunks[TARGET][-1][2]
    assert_same("scattered blocks", ref, scattered)

    # A prefix computed by another request (chunked otherwise), then the whole prompt cached.
    engine = make_engine(checkpoint, batch_invariant=True, budget=rng.choice([7, 16, 64]))
    shared = rng.randint(16, len(target))
    run(engine, [(0, "donor", target[:shared] + prompt(rng, rng.randint(1, 40)))])
    hit = run(engine, [(0, TARGET, target)] + others(rng, 2))
    assert hit.chunks[TARGET][0][0] == shared // 16 * 16 > 0
    assert_same("prefix hit", ref, hit)
    again = run(engine, [(0, TARGET, target)])
    assert again.chunks[TARGET][0][0] >= (len(target) - 1) // 16 * 16
    assert_same("whole prompt cached", ref, again)
