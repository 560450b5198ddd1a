"""Online predictors: the regressor learns online, per-tool quantiles, LAMPS accuracy math, the noise
knob, the engine's wiring on a tiny model (hidden states included) and the /metrics lines."""
from __future__ import annotations

import math
import re
from typing import Any, Iterator

import httpx
import numpy as np
import pytest
import torch
import transformers

from conftest import make_tiny_checkpoint
from engine_helpers import run_to_completion
from segue.config import CacheConfig, ConfigError, EngineConfig, ModelLoadConfig, PredictorConfig, SchedulerConfig
from segue.engine.engine_request import EngineRequest
from segue.engine.llm_engine import LLMEngine
from segue.predict.accuracy import AccuracyTracker
from segue.predict.noise import GaussianNoise
from segue.predict.online import OUTPUT_HIDDEN, OUTPUT_PROMPT, TOOL_DURATION, OnlinePredictors
from segue.predict.output_length import OutputLengthPredictor
from segue.predict.regressor import OnlineRidge
from segue.predict.tool_duration import ToolDurationPredictor
from segue.request import Interception, Request
from segue.sampling_params import SamplingParams
from segue.sim.script import scripted
from segue.sim.trace import TraceSegment
from segue.tools.stats import DurationStats


# ---- the regressor ----------------------------------------------------------------------------
def test_ridge_learns_a_linear_relation_online() -> None:
    rng = np.random.default_rng(0)
    true_w = np.array([1.5, -0.8, 0.3, 0.0, 0.0])  # two features carry nothing
    model = OnlineRidge(dim=5, window=256, alpha=1.0)
    assert model.predict(np.zeros(5)) is None
    errors = []
    for _ in range(400):
        x = rng.normal(size=5) * np.array([1.0, 2.0, 5.0, 1.0, 100.0])  # features of unequal scale
        y = 2.0 + x @ true_w + rng.normal(0.0, 0.05)
        pred = model.predict(x)
        if pred is not None:
            errors.append(abs(pred - y))
        model.observe(x, y)
    early, late = np.mean(errors[:10]), np.mean(errors[-100:])
    # Noise sigma 0.05 means E|noise| = 0.04: the late error is the noise floor, the early one is not.
    assert late < 0.1, late
    assert early > 10 * late


def test_ridge_window_follows_drift_and_one_sample_predicts_its_mean() -> None:
    model = OnlineRidge(dim=2, window=50)
    model.observe(np.array([1.0, 2.0]), 7.0)
    assert model.predict(np.array([9.0, -3.0])) == pytest.approx(7.0)
    for y in (10.0,) * 50:
        model.observe(np.array([0.0, 0.0]), y)
    assert model.num_samples == 50 and model.num_observed == 51
    assert model.predict(np.array([0.0, 0.0])) == pytest.approx(10.0)  # the 7 fell out of the window
    with pytest.raises(ValueError):
        model.observe(np.array([1.0]), 1.0)
    with pytest.raises(ValueError):
        model.observe(np.array([1.0, math.nan]), 1.0)


def test_output_length_predicts_in_log_space_within_bounds() -> None:
    p = OutputLengthPredictor(dim=1)
    assert p.predict(np.array([0.0])) is None
    for n in (10, 20, 40, 80, 160) * 20:  # tokens = 3 * prompt length, a power law: linear in logs
        p.observe(np.array([math.log1p(n)]), 3 * n)
    assert p.predict(np.array([math.log1p(50)])) == pytest.approx(150, rel=0.1)
    assert p.predict(np.array([math.log1p(50)]), max_tokens=20) == 20  # never past what max_tokens allows
    zeros = OutputLengthPredictor(dim=1)
    for _ in range(5):
        zeros.observe(np.array([1.0]), 0)
    assert zeros.predict(np.array([1.0])) == 1.0  # never below one token, never negative


# ---- tool durations ---------------------------------------------------------------------------
def test_tool_duration_per_tool_quantiles_with_fallbacks() -> None:
    stats = DurationStats()
    for d in (1.0, 2.0, 3.0, 4.0, 100.0):
        stats.observe("search", d)
    for d in (10.0, 10.0, 12.0):
        stats.observe("image", d)
    median = ToolDurationPredictor(stats)
    assert median.predict("search") == 3.0  # the median shrugs off the 100 s outlier
    assert median.predict("image") == 10.0
    assert ToolDurationPredictor(stats, quantile=0.9).predict("search") == pytest.approx(
        float(np.quantile([1.0, 2.0, 3.0, 4.0, 100.0], 0.9)))
    assert median.predict("search", hint_s=42.0) == 42.0  # the client's hint wins
    assert median.predict("unknown") is None  # nothing observed anywhere yet
    stats.set_hint("calc", 0.5)
    assert median.predict("calc") == 0.5  # the tool spec's expected_seconds before any observation
    for d in (1.0, 5.0, 9.0):
        median.observe(d)
    assert median.predict("unknown") == 5.0  # unknown tools: the median over every interception
    assert median.predict(None) == 5.0
    with pytest.raises(ValueError):
        ToolDurationPredictor(stats, quantile=1.5)


# ---- accuracy and noise -----------------------------------------------------------------------
def test_accuracy_mae_acc5_acc15_hand_worked() -> None:
    t = AccuracyTracker("x")
    s = t.snapshot()
    assert s.count == 0 and s.mae is None and s.acc(5) is None
    # |errors| = 2, 10, 20, 0, 5, 15: MAE 52/6; within 5: {2, 0, 5}; within 15: all but 20 (bounds count).
    for predicted, actual in ((10, 12), (100, 110), (50, 30), (7, 7), (20, 25), (0, 15)):
        t.record(predicted, actual)
    s = t.snapshot()
    assert s.count == 6
    assert s.mae == pytest.approx(52 / 6)
    assert s.acc(5) == pytest.approx(3 / 6)
    assert s.acc(15) == pytest.approx(5 / 6)
    with pytest.raises(KeyError):
        s.acc(10)


def test_noise_has_the_configured_relative_spread_and_is_seeded() -> None:
    assert GaussianNoise(0.0).apply(123.0) == 123.0
    a = [GaussianNoise(0.2, seed=3).apply(100.0) for _ in range(3)]
    assert len(set(a)) == 1  # a fresh generator with the same seed draws the same first value
    noise = GaussianNoise(0.2, seed=1)
    draws = np.array([noise.apply(100.0) for _ in range(20000)])
    assert draws.mean() == pytest.approx(100.0, abs=0.5)
    assert draws.std() == pytest.approx(20.0, rel=0.03)
    wide = GaussianNoise(2.0, seed=1)
    assert min(wide.apply(10.0) for _ in range(2000)) == 0.0  # clipped, never negative
    with pytest.raises(ValueError):
        GaussianNoise(-0.1)
    with pytest.raises(ConfigError):
        PredictorConfig(noise_sigma=-1).validate()
    with pytest.raises(ConfigError):
        PredictorConfig(feature_source="tea leaves").validate()


# ---- the engine-facing hub, without a model ---------------------------------------------------
def _generate(req: Request, n: int) -> None:
    req.output_token_ids.extend([7] * n)


def test_hub_lifecycle_learns_segments_and_scores_what_policies_saw() -> None:
    p = OnlinePredictors(PredictorConfig(), DurationStats())  # no executor: prompt features only
    assert not p.use_hidden
    t = 0.0
    for i in range(30):
        req = Request(f"r{i}", [1] * 20, SamplingParams(max_tokens=100), t)
        p.on_arrival(req)
        if i > 0:
            assert req.predicted_output_tokens is not None
        _generate(req, 8)  # first segments: 8 tokens, then a 2 s "search"
        p.on_intercept(req, "search")
        p.tool_duration.stats.observe("search", 2.0)  # the engine feeds per-tool windows itself
        req.interception = Interception(t_call=t, tool="search")
        p.on_resume(req, num_appended=5, now=t + 2.0)
        req.interception = None
        req.interceptions.append(Interception(t_call=t, tool="search", t_resume=t + 2.0))
        req.output_token_ids.extend([3] * 5)
        req.num_appended_tokens += 5
        _generate(req, 30)  # second segments: 30 tokens
        p.on_finish(req)
    assert p.num_tracked == 0
    snap = p.snapshot()
    # Every segment is predicted once one has been observed: all but the very first.
    assert snap[OUTPUT_PROMPT].count == 2 * 30 - 1
    assert snap[TOOL_DURATION].count == 29
    assert snap[OUTPUT_HIDDEN].count == 0
    # The segment index tells the two lengths apart, and tools repeat their duration.
    fresh = Request("new", [1] * 20, SamplingParams(max_tokens=100), t)
    p.on_arrival(fresh)
    assert fresh.predicted_output_tokens == pytest.approx(8, abs=0.5)
    _generate(fresh, 8)
    p.on_intercept(fresh, "search")
    assert fresh.predicted_interception_s == 2.0
    fresh.interception = Interception(t_call=0.0, tool="search")
    p.on_resume(fresh, num_appended=5, now=2.0)
    assert fresh.predicted_output_tokens == pytest.approx(30, abs=1.5)
    p.forget("new")
    assert p.num_tracked == 0


def test_hub_noise_reaches_the_requests() -> None:
    def predictions(sigma: float) -> list[float]:
        p = OnlinePredictors(PredictorConfig(noise_sigma=sigma, seed=5), DurationStats())
        out = []
        for i in range(200):
            req = Request(f"r{i}", [1] * 10, SamplingParams(max_tokens=1000), 0.0)
            p.on_arrival(req)
            if req.predicted_output_tokens is not None:
                out.append(req.predicted_output_tokens)
            req.output_token_ids.extend([7] * 50)
            p.on_finish(req)
        return out

    clean, noisy = np.array(predictions(0.0)), np.array(predictions(0.3))
    assert np.allclose(clean, 50.0)
    assert np.std(noisy / clean) == pytest.approx(0.3, rel=0.15)


def test_max_tokens_caps_predictions_unless_turned_off() -> None:
    for clip, expected in ((True, 10.0), (False, 40.0)):
        p = OnlinePredictors(PredictorConfig(clip_to_max_tokens=clip), DurationStats())
        for i in range(3):
            req = Request(f"r{i}", [1] * 10, SamplingParams(max_tokens=1000), 0.0)
            p.on_arrival(req)
            req.output_token_ids.extend([7] * 40)
            p.on_finish(req)
        short = Request("short", [1] * 10, SamplingParams(max_tokens=10), 0.0)
        p.on_arrival(short)
        assert short.predicted_output_tokens == pytest.approx(expected)


def test_disabled_predictors_set_nothing() -> None:
    p = OnlinePredictors(PredictorConfig(enabled=False), DurationStats())
    req = Request("r", [1] * 10, SamplingParams(max_tokens=10), 0.0)
    p.on_arrival(req)
    req.output_token_ids.append(1)
    p.on_finish(req)
    assert req.predicted_output_tokens is None and p.snapshot()[OUTPUT_PROMPT].count == 0


# ---- the engine on a tiny model ---------------------------------------------------------------
@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny")


def _engine(ckpt: Any, **predictor: Any) -> LLMEngine:
    # Full-precision weights: the hidden-state test compares with transformers' fp32 forward.
    return LLMEngine(EngineConfig(
        model=ModelLoadConfig(model=str(ckpt), dtype="float32", device="cpu", quantization="none"),
        cache=CacheConfig(block_size=4, kv_cache_tokens=512),
        scheduler=SchedulerConfig(max_num_batched_tokens=64),
        predictor=PredictorConfig(**predictor)))


def test_engine_predicts_learns_and_scores(ckpt: Any) -> None:
    engine = _engine(ckpt)
    assert engine.predictors.use_hidden  # the torch executor returns hidden states
    params = SamplingParams(max_tokens=64, ignore_eos=True)
    script = [TraceSegment(4, 0.005, [5, 6, 7], "search"), TraceSegment(3)]
    for i in range(6):
        scripted(engine).add_request(EngineRequest(list(range(10, 20 + 3 * i)), params, f"a{i}"), script)
    run_to_completion(engine)
    snap = engine.predictors.snapshot()
    # The six first segments ran before anything was learned; their second segments were predicted.
    # (How many pauses began before another had ended, with nothing to go on, depends on timing.)
    assert snap[OUTPUT_PROMPT].count == 6
    assert engine.tool_stats.count("search") == 6
    assert engine.predictors.output_prompt.num_observed == 12
    assert engine.predictors.output_hidden.num_observed == 12
    assert engine.predictors.num_tracked == 0

    req = scripted(engine).add_request(EngineRequest(list(range(10, 25)), params, "b"), script)
    assert req.predicted_output_tokens == pytest.approx(4, abs=1)  # first segments were 4 tokens
    assert req.predicted_interception_s is not None and req.predicted_interception_s >= 0.005
    engine.step()  # the prefill: the hidden-state regressor refines the guess
    assert req.predicted_output_tokens == pytest.approx(4, abs=1)
    run_to_completion(engine)
    after = engine.predictors.snapshot()
    assert after[OUTPUT_PROMPT].count == snap[OUTPUT_PROMPT].count + 2
    assert after[OUTPUT_HIDDEN].count == snap[OUTPUT_HIDDEN].count + 2
    assert after[TOOL_DURATION].count == snap[TOOL_DURATION].count + 1
    assert after[OUTPUT_PROMPT].mae is not None and after[OUTPUT_PROMPT].mae < 2


def test_hidden_state_is_the_models_final_norm_output(ckpt: Any) -> None:
    engine = _engine(ckpt)
    seen: dict[str, np.ndarray] = {}
    real = engine.predictors.on_hidden_state

    def capture(request: Request, hidden: np.ndarray) -> None:
        seen[request.request_id] = hidden
        real(request, hidden)

    engine.predictors.on_hidden_state = capture  # type: ignore[method-assign]
    executed: list[dict] = []
    real_execute = engine.executor.execute

    def execute(out: Any) -> dict:
        sampled = real_execute(out)
        executed.append(sampled)
        return sampled

    engine.executor.execute = execute  # type: ignore[method-assign]
    prompt = [5, 17, 99, 123, 8, 64, 3]
    engine.add_request(EngineRequest(prompt, SamplingParams(max_tokens=3, ignore_eos=True), "h"))
    run_to_completion(engine)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(ckpt), torch_dtype=torch.float32).eval()
    with torch.no_grad():
        ref = model.model(torch.tensor([prompt])).last_hidden_state[0, -1].numpy()
    assert seen["h"].shape == ref.shape
    np.testing.assert_allclose(seen["h"], ref, rtol=1e-4, atol=1e-4)
    # Asked once, for the prefill; the decode steps carry no hidden state.
    assert [s["h"].hidden is not None for s in executed] == [True, False, False]


def test_prompt_source_and_disabled_engine_never_ask_for_hidden_states(ckpt: Any) -> None:
    for kwargs in (dict(feature_source="prompt"), dict(enabled=False)):
        engine = _engine(ckpt, **kwargs)
        assert not engine.predictors.use_hidden
        for i in range(3):
            engine.add_request(EngineRequest([4, 5, 6, 7 + i], SamplingParams(max_tokens=2, ignore_eos=True), f"p{i}"))
        run_to_completion(engine)
        assert engine.predictors.output_hidden.num_observed == 0
        expected = 0 if kwargs.get("enabled") is False else 3
        assert engine.predictors.output_prompt.num_observed == expected


# ---- /metrics ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server_engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    from server_helpers import engine_fixture
    gen = engine_fixture(tmp_path_factory)
    engine, _ = next(gen)
    yield engine
    next(gen, None)


def test_metrics_export_predictor_accuracy(server_engine: Any) -> None:
    from segue.server.app import create_app
    from server_helpers import ServerThread, wait_idle

    with ServerThread(create_app(server_engine)) as s:
        for prompt in ("hello there", "hello again, model"):
            r = httpx.post(s.url + "/v1/completions", timeout=60,
                           json={"prompt": prompt, "max_tokens": 3, "ignore_eos": True})
            assert r.status_code == 200, r.text
        text = httpx.get(s.url + "/metrics", timeout=30).text
    wait_idle(server_engine)
    for name in (OUTPUT_PROMPT, OUTPUT_HIDDEN):
        m = re.search(rf'^segue_predictor_samples_total{{predictor="{name}"}} (\S+)$', text, re.M)
        assert m and float(m.group(1)) >= 1, name
        assert re.search(rf'^segue_predictor_mae{{predictor="{name}"}} \S+$', text, re.M), name
        for tol in ("5", "15"):
            line = re.search(rf'^segue_predictor_accuracy{{predictor="{name}",tolerance="{tol}"}} (\S+)$',
                             text, re.M)
            assert line and 0.0 <= float(line.group(1)) <= 1.0, (name, tol)
    # Nothing paused yet: the duration predictor is listed with zero samples and no made-up accuracy.
    assert f'segue_predictor_samples_total{{predictor="{TOOL_DURATION}"}} 0.0' in text
    assert f'segue_predictor_mae{{predictor="{TOOL_DURATION}"}}' not in text
