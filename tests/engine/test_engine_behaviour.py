"""Engine behaviour on a tiny checkpoint: bad input, aborts, stop conditions, sampling options."""
from __future__ import annotations

import pytest

from conftest import make_tiny_checkpoint
from engine_helpers import run_to_completion
from segue.config import CacheConfig, EngineConfig, ModelLoadConfig, SchedulerConfig
from segue.engine.engine_request import EngineRequest
from segue.engine.llm import LLM
from segue.engine.llm_engine import LLMEngine
from segue.model.loader import CheckpointError
from segue.sampling_params import InvalidRequestError, SamplingParams


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny")


@pytest.fixture
def engine(ckpt):
    return LLMEngine(EngineConfig(
        model=ModelLoadConfig(model=str(ckpt), dtype="float32", device="cpu"),
        cache=CacheConfig(block_size=4, kv_cache_tokens=256),
        scheduler=SchedulerConfig(max_num_batched_tokens=64)))


def test_missing_and_corrupt_checkpoints_fail_clearly(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist|not found|no such"):
        LLM(model=str(tmp_path / "nope"))
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError):
        LLM(model=str(bad))


@pytest.mark.parametrize("kwargs", [
    dict(max_tokens=0), dict(max_tokens=-3), dict(temperature=-1.0), dict(top_p=0.0), dict(top_p=1.5),
    dict(top_k=-7), dict(logprobs=99), dict(stop=[""]), dict(seed="x"),
])
def test_bad_sampling_values_are_rejected(kwargs):
    with pytest.raises(InvalidRequestError):
        SamplingParams(**kwargs)


def test_bad_requests_fail_alone_and_the_engine_keeps_serving(engine):
    good = engine.add_request(EngineRequest([5, 6, 7, 8], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True),
                                            "good"))
    with pytest.raises(InvalidRequestError, match="context window"):
        engine.add_request(EngineRequest(list(range(100, 100 + engine.max_model_len)), SamplingParams(), "long"))
    with pytest.raises(InvalidRequestError, match="empty"):
        engine.add_request(EngineRequest([], SamplingParams(), "empty"))
    with pytest.raises(InvalidRequestError, match="token ids"):
        engine.add_request(EngineRequest([10**9], SamplingParams(), "oov"))
    with pytest.raises(InvalidRequestError, match="already in use"):
        engine.add_request(EngineRequest([1, 2], SamplingParams(), "good"))
    results = run_to_completion(engine)
    assert list(results) == ["good"] and len(good.output_token_ids) == 5


def test_abort_frees_everything_mid_generation(engine):
    for i in range(6):
        engine.add_request(EngineRequest(list(range(50 + i, 90 + i)), SamplingParams(max_tokens=40, ignore_eos=True),
                                         f"r{i}"))
    for _ in range(15):
        engine.step()
        engine.check_invariants()
    for i in range(0, 6, 2):
        out = engine.abort_request(f"r{i}")
        assert out.finished and out.outputs[0].finish_reason == "abort"
        engine.check_invariants()
    assert engine.abort_request("unknown") is None
    results = run_to_completion(engine)
    assert sorted(results) == ["r1", "r3", "r5"]


def test_executor_failure_fails_the_batch_not_the_engine(engine, monkeypatch):
    engine.add_request(EngineRequest([1, 2, 3], SamplingParams(max_tokens=4), "doomed"))
    real = engine.executor.execute
    monkeypatch.setattr(engine.executor, "execute", lambda out: (_ for _ in ()).throw(RuntimeError("boom")))
    outs = engine.step()
    assert [o.outputs[0].finish_reason for o in outs] == ["abort"]
    engine.check_invariants()
    monkeypatch.setattr(engine.executor, "execute", real)
    engine.add_request(EngineRequest([1, 2, 3], SamplingParams(max_tokens=4, ignore_eos=True), "after"))
    assert len(run_to_completion(engine)["after"].outputs[0].token_ids) == 4


def test_stop_conditions(engine):
    base = run_to_completion_single(engine, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    tokens, text = base.outputs[0].token_ids, base.outputs[0].text
    assert base.outputs[0].finish_reason == "length"
    # A stop token id ends generation at its first occurrence, and is reported as the reason.
    stop_id = tokens[4]
    out = run_to_completion_single(engine, SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[stop_id]))
    assert out.outputs[0].token_ids == tokens[:tokens.index(stop_id) + 1]
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == stop_id
    # A stop string is cut from the text.
    stop = text.strip()[3:6]
    if stop.strip():
        out = run_to_completion_single(engine, SamplingParams(temperature=0, max_tokens=12, stop=[stop],
                                                              ignore_eos=True))
        assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == stop
        assert stop not in out.outputs[0].text and text.startswith(out.outputs[0].text)


def test_seeded_sampling_is_reproducible_and_logprobs_are_reported(engine):
    params = SamplingParams(temperature=0.9, top_p=0.9, top_k=50, seed=1234, max_tokens=8, logprobs=3,
                            ignore_eos=True)
    a = run_to_completion_single(engine, params)
    # Same seed inside a busy batch gives the same tokens.
    for i in range(3):
        engine.add_request(EngineRequest([7 + i, 8, 9], SamplingParams(temperature=1.0, max_tokens=8), f"noise{i}"))
    b = run_to_completion_single(engine, params)
    assert a.outputs[0].token_ids == b.outputs[0].token_ids
    lps = a.outputs[0].logprobs
    assert len(lps) == 8 and all(len(lp.top) == 3 and lp.logprob <= 0.0 for lp in lps)
    assert [lp.token_id for lp in lps] == a.outputs[0].token_ids


def run_to_completion_single(engine, params):
    rid = engine.add_request(EngineRequest([11, 12, 13, 14, 15], params)).request_id
    return run_to_completion(engine)[rid]
