"""`segue profile`: the joint non-negative step-time fit, the profile JSON, and a tiny-model run."""
from __future__ import annotations

import itertools
import json

import numpy as np
import pytest

from segue.config import CacheConfig, EngineConfig, ModelLoadConfig
from segue.engine.llm_engine import LLMEngine
from segue.executor.step_fit import StepPoint, fit_steps, nnls
from segue.profiler import steps as profiler
from segue.sched.cost_model import CostModel, mean_cost_model


def _synthetic(a: float, b: float, c: float, noise: float = 0.0, seed: int = 0) -> list[StepPoint]:
    """Prefills of 1..1024 tokens, B x C decode batches and mixed steps, timed by a known model."""
    rng = np.random.default_rng(seed)
    shapes = [("prefill", t, t, 1) for t in (1, 16, 64, 256, 512, 1024)]
    shapes += [("decode", bb, bb * cc, bb) for bb, cc in itertools.product((1, 4, 16, 32), (128, 512, 1024))]
    shapes += [("mixed", 128 + bb, 128 + bb * 256, bb + 1) for bb in (1, 8)]
    return [StepPoint(kind, tokens, ctx, seqs, (a * tokens + b + c * ctx) * (1 + noise * rng.standard_normal()))
            for kind, tokens, ctx, seqs in shapes]


def test_fit_recovers_known_coefficients() -> None:
    fit = fit_steps(_synthetic(2.0, 50.0, 0.01))
    assert fit.ms_per_token == pytest.approx(2.0, rel=1e-6)
    assert fit.base_ms == pytest.approx(50.0, rel=1e-6)
    assert fit.ms_per_context_token == pytest.approx(0.01, rel=1e-6)
    assert fit.r2 == pytest.approx(1.0)
    assert set(fit.residuals) == {"prefill", "decode", "mixed"}
    assert all(abs(r["mean_rel_error"]) < 1e-6 for r in fit.residuals.values())


def test_fit_with_noise_stays_close() -> None:
    fit = fit_steps(_synthetic(2.0, 50.0, 0.01, noise=0.03))
    assert fit.ms_per_token == pytest.approx(2.0, rel=0.1)
    assert fit.base_ms == pytest.approx(50.0, rel=0.15)
    assert fit.ms_per_context_token == pytest.approx(0.01, rel=0.3)


def test_superlinear_prefill_keeps_a_positive_intercept() -> None:
    # Prefill with a quadratic attention term: a line through the prefills alone has a negative
    # intercept (the failure `segue profile` had); the joint fit with decode steps keeps the base.
    prefill = [StepPoint("prefill", t, t, 1, 3.0 * t + 40.0 + 0.004 * t * t) for t in (1, 16, 64, 256, 512, 1024)]
    xs = np.array([p.batched_tokens for p in prefill], float)
    _, intercept = np.polyfit(xs, [p.step_ms for p in prefill], 1)
    assert intercept < 0
    decode = [StepPoint("decode", bb, bb * cc, bb, 3.0 * bb + 40.0 + 0.02 * bb * cc)
              for bb, cc in itertools.product((1, 4, 16), (128, 512))]
    fit = fit_steps(prefill + decode)
    # The decode steps pin the per-step base and the context cost near their true values.
    assert fit.base_ms == pytest.approx(40.0, rel=0.1)
    assert fit.ms_per_context_token == pytest.approx(0.02, rel=0.2)
    assert abs(fit.residuals["decode"]["mean_rel_error"]) < 0.1


def test_fit_separates_prefill_attention_from_context() -> None:
    # Chunks over long prefixes (an agent's next turn) cost tokens x context in attention, which
    # the context term cannot carry; the pair term recovers it beside the other coefficients.
    from segue.sched.cost_model import attended_pairs

    def ms(tokens: int, ctx: int, pairs: int) -> float:
        return 2.0 * tokens + 50.0 + 0.01 * ctx + 1e-4 * pairs

    points = [StepPoint(p.kind, p.batched_tokens, p.context_tokens, p.num_seqs, 0.0,
                        attended_pairs=p.context_tokens if p.kind == "decode" else attended_pairs(0, p.batched_tokens))
              for p in _synthetic(1.0, 1.0, 0.0) if p.kind != "mixed"]
    points += [StepPoint("prefill", n, start + n, 1, 0.0, attended_pairs=attended_pairs(start, n))
               for start, n in ((1024, 512), (3072, 512), (3584, 256))]
    points = [StepPoint(p.kind, p.batched_tokens, p.context_tokens, p.num_seqs,
                        ms(p.batched_tokens, p.context_tokens, p.attended_pairs), attended_pairs=p.attended_pairs)
              for p in points]
    fit = fit_steps(points)
    assert fit.ms_per_attended_pair == pytest.approx(1e-4, rel=1e-6)
    assert fit.ms_per_context_token == pytest.approx(0.01, rel=1e-6)
    long_chunk = attended_pairs(3072, 512)
    assert fit.predict_ms(512, 3584, pairs=long_chunk) == pytest.approx(ms(512, 3584, long_chunk))
    # Without the pair term the same points leave the long chunks under-predicted.
    flat = fit_steps([StepPoint(p.kind, p.batched_tokens, p.context_tokens, p.num_seqs, p.step_ms) for p in points])
    assert flat.predict_ms(512, 3584) < 0.95 * ms(512, 3584, long_chunk)


def test_attended_pairs_and_the_step_time_the_simulator_charges() -> None:
    from segue.sched.cost_model import attended_pairs

    assert attended_pairs(0, 1) == 1 and attended_pairs(99, 1) == 100  # a decode token sees its context
    assert attended_pairs(0, 4) == 1 + 2 + 3 + 4
    assert attended_pairs(10, 3) == 11 + 12 + 13
    cost = CostModel(fwd_ms_per_token=1.0, fwd_base_ms=10.0, fwd_ms_per_context_token=0.01,
                     fwd_ms_per_attended_pair=1e-4)
    assert cost.t_step(100, 1000, 50_000) == pytest.approx((110.0 + 10.0 + 5.0) / 1000)
    # Recompute is priced with its attention: the marginal token cost plus the pairs it attends.
    assert cost.t_prefill(100, 1000) == pytest.approx((100.0 + 1e-4 * attended_pairs(1000, 100)) / 1000)
    flat = CostModel(fwd_ms_per_token=1.0, fwd_base_ms=10.0, fwd_ms_per_context_token=0.01)
    assert flat.t_prefill(100, 1000) == flat.t_fwd_extra(100)
    # So discarding a long context costs more than its tokens alone say, and more so the longer it is.
    extra = [cost.waste_chunked_discard(c, 500, 2) / flat.waste_chunked_discard(c, 500, 2) for c in (256, 4096)]
    assert 1.0 < extra[0] < extra[1]


def test_nnls_matches_unconstrained_when_feasible_and_clips_otherwise() -> None:
    rng = np.random.default_rng(1)
    x = rng.uniform(0, 1, size=(20, 3))
    y = x @ np.array([1.0, 2.0, 3.0])
    assert nnls(x, y) == pytest.approx([1.0, 2.0, 3.0])
    y = x @ np.array([1.0, -2.0, 3.0])
    w = nnls(x, y)
    assert w[1] == 0 and np.all(w >= 0)
    # Optimal among non-negative solutions: no feasible perturbation does better.
    err = np.sum((x @ w - y) ** 2)
    for dw in itertools.product((-1e-3, 0, 1e-3), repeat=3):
        cand = np.maximum(w + np.array(dw), 0)
        assert np.sum((x @ cand - y) ** 2) >= err - 1e-12


def test_fit_rejects_too_few_points() -> None:
    with pytest.raises(ValueError):
        fit_steps(_synthetic(1.0, 1.0, 0.0)[:2])


def test_per_seq_fit_finds_a_per_sequence_cost() -> None:
    points = [StepPoint(p.kind, p.batched_tokens, p.context_tokens, p.num_seqs, p.step_ms + 3.0 * p.num_seqs)
              for p in _synthetic(2.0, 50.0, 0.01)]
    fit = fit_steps(points, per_seq=True)
    assert fit.ms_per_seq == pytest.approx(3.0, rel=1e-6)
    assert fit.mean_abs_rel_error < fit_steps(points).mean_abs_rel_error


def _ramp_then_line(tokens: float) -> float:
    """A CPU-like step: weight-bound up to 1 token, a steep ramp to 16, then linear compute."""
    if tokens <= 1:
        return 60.0
    if tokens <= 16:
        return 60.0 + (tokens - 1) * 5.0
    return 135.0 + (tokens - 16) * 2.5


def test_curve_fit_follows_a_shape_no_line_fits() -> None:
    shapes = [("prefill", t, t, 1) for t in (16, 64, 256, 1024)]
    shapes += [("decode", bb, bb * cc, bb) for bb, cc in itertools.product((1, 4, 16, 32), (128, 1024))]
    points = [StepPoint(kind, t, ctx, seqs, _ramp_then_line(t) + 0.01 * ctx) for kind, t, ctx, seqs in shapes]
    line, curve = fit_steps(points), fit_steps(points, curve=True)
    assert curve.mean_abs_rel_error < 1e-6 < line.mean_abs_rel_error
    assert curve.ms_per_context_token == pytest.approx(0.01, rel=1e-6)
    assert [k for k, _ in curve.curve] == [1, 4, 16, 32, 64, 256, 1024]
    for tokens in (1, 3, 10, 100, 2048):  # between knots, and past the last one with its slope
        assert curve.predict_ms(tokens, 0) == pytest.approx(_ramp_then_line(tokens), rel=1e-6)
    # The rises are non-negative coefficients, so the curve never goes down even with noise.
    noisy = [StepPoint(p.kind, p.batched_tokens, p.context_tokens, p.num_seqs, p.step_ms * (1.3 if i % 2 else 0.8))
             for i, p in enumerate(points)]
    levels = [ms for _, ms in fit_steps(noisy, curve=True).curve]
    assert levels == sorted(levels)


def test_cost_model_charges_its_curve_and_round_trips(tmp_path) -> None:
    cost = CostModel(fwd_ms_per_token=2.5, fwd_base_ms=60.0, fwd_curve_ms=[[1, 60.0], [16, 135.0], [1024, 2655.0]])
    assert cost.t_fwd(0) == pytest.approx(0.060)
    assert cost.t_fwd(4) == pytest.approx(0.075)
    assert cost.t_fwd(2048) == pytest.approx(5.215)
    assert cost.t_fwd_extra(100) == pytest.approx(0.25)  # the marginal cost stays the line's slope
    cost.save(tmp_path / "c.json")
    assert CostModel.load(tmp_path / "c.json") == cost
    assert CostModel(fwd_ms_per_token=2.5, fwd_base_ms=60.0).t_fwd(4) == pytest.approx(0.070)


@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory: pytest.TempPathFactory) -> str:
    from conftest import make_tiny_checkpoint

    return str(make_tiny_checkpoint(tmp_path_factory.mktemp("tiny")))


@pytest.fixture(scope="module")
def tiny_engine(tiny_ckpt: str) -> LLMEngine:
    config = EngineConfig(model=ModelLoadConfig(model=tiny_ckpt),
                          cache=CacheConfig(kv_cache_tokens=2048, swap_space_tokens=256))
    return LLMEngine(config.validate())


def test_mean_of_two_profiles_charges_the_mean_step_time() -> None:
    before = CostModel(fwd_ms_per_token=2.0, fwd_base_ms=60.0, fwd_curve_ms=[[1, 60.0], [128, 380.0]],
                       fwd_ms_per_context_token=0.02)
    after = CostModel(fwd_ms_per_token=3.0, fwd_base_ms=70.0, fwd_curve_ms=[[1, 70.0], [128, 460.0]],
                      fwd_ms_per_context_token=0.04)
    mean = mean_cost_model(before, after, "around")
    for tokens in (1, 64, 128, 300):
        assert mean.t_fwd(tokens) == pytest.approx((before.t_fwd(tokens) + after.t_fwd(tokens)) / 2)
    assert mean.fwd_ms_per_context_token == pytest.approx(0.03) and mean.source == "around"
    with pytest.raises(ValueError, match="different step-time curves"):
        mean_cost_model(before, CostModel(fwd_curve_ms=[[1, 60.0], [64, 200.0]]), "x")


def test_tiny_profile_writes_a_loadable_profile(tiny_engine: LLMEngine, tmp_path) -> None:
    cost, report = profiler.profile(tiny_engine, grid=profiler.TINY_GRID)
    assert not tiny_engine.has_unfinished_requests()
    assert "execute" not in vars(tiny_engine.executor)  # the timing wrapper is gone
    kinds = {p.kind for p in report.points}
    assert kinds == {"prefill", "decode", "mixed"}
    # The context prefill: a 16-token chunk over the 96 cached tokens of its prefix.
    assert any(p.batched_tokens == 16 and p.context_tokens == 112 and p.attended_pairs == 16 * 96 + 136
               for p in report.points)
    # The cost model the engine loads carries the joint fit the report shows, not another one.
    assert (cost.fwd_ms_per_attended_pair, cost.fwd_ms_per_context_token) == (
        report.fit.ms_per_attended_pair, report.fit.ms_per_context_token)
    assert (cost.fwd_ms_per_token, cost.fwd_base_ms) == (max(report.line_fit.ms_per_token, 1e-6),
                                                         report.line_fit.base_ms)
    decodes = [p for p in report.points if p.kind == "decode"]
    assert {p.num_seqs for p in decodes} == {1, 4, 2}
    assert all(p.batched_tokens == p.num_seqs for p in decodes)
    assert cost.fwd_ms_per_token > 0 and cost.swap_bytes_per_s > 0
    path = tmp_path / "profile.json"
    profiler.save_profile(path, cost, report)
    data = json.loads(path.read_text())
    assert {"fit", "line_fit", "per_seq_fit", "points", "wall_over_cpu_median", "fwd_curve_ms"} <= set(data)
    assert cost.fwd_curve_ms == report.fit.curve and len(cost.fwd_curve_ms) >= 2
    assert set(data["fit"]["residuals"]) == kinds
    assert len(data["points"]) == len(report.points)
    assert CostModel.load(path) == cost


def test_profile_skips_what_the_engine_cannot_hold(tiny_engine: LLMEngine) -> None:
    grid = profiler.ProfileGrid(prefill_tokens=(8, 100000), decode_groups=((2, 16), (4096, 16), (1, 100000)),
                                decode_steps=2, mixed_prompt=0, repeats=1, context_prefills=((100000, 16),))
    points, skipped = profiler.measure_steps(tiny_engine, grid)
    assert len(skipped) == 4
    assert {p.kind for p in points} == {"prefill", "decode"}


def test_cpu_timer_fits_cpu_time(tiny_engine: LLMEngine) -> None:
    cost, report = profiler.profile(tiny_engine, grid=profiler.TINY_GRID, timer="cpu")
    assert report.timer == "cpu" and "cpu time" in cost.source
    assert all(p.cpu_ms > 0 for p in report.points)
    with pytest.raises(ValueError):
        profiler.profile(tiny_engine, grid=profiler.TINY_GRID, timer="gpu")


def test_cli_profile_writes_the_json(tiny_ckpt: str, tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    from segue.cli import main

    out = tmp_path / "p.json"
    assert main(["--log-level", "WARNING", "profile", "--model", tiny_ckpt, "--grid", "tiny", "--output", str(out),
                 "--kv-cache-tokens", "2048", "--swap-space-tokens", "256"]) == 0
    assert "R^2" in capsys.readouterr().out
    assert CostModel.load(out).fwd_ms_per_token > 0
    assert json.loads(out.read_text())["timer"] == "wall"
