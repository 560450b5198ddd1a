"""What a copy beside the forward pass costs: the profiler's measurement on a tiny model, what it
records, and what a CPU engine does with it (nothing: its swaps stall, measured or not)."""
from __future__ import annotations

import pytest

from segue.config import CacheConfig, EngineConfig, ModelLoadConfig
from segue.engine.engine_request import EngineRequest
from segue.engine.llm_engine import LLMEngine
from segue.profiler.overlap import OverlapProfile, measure_swap_overlap
from segue.sched.cost_model import CostModel, mean_cost_model


def test_profile_measures_a_decode_beside_a_copy(tmp_path) -> None:
    from conftest import make_tiny_checkpoint

    ckpt = make_tiny_checkpoint(tmp_path / "tiny")
    engine = LLMEngine(EngineConfig(model=ModelLoadConfig(model=str(ckpt)),
                                    cache=CacheConfig(kv_cache_tokens=2048, swap_space_tokens=1024)).validate())
    cache = engine.executor.kv_cache
    cache.k.fill_(0.5)  # marks the device blocks, so the host blocks show whether they were copied
    overlap = measure_swap_overlap(engine, repeats=2)
    assert overlap is not None
    assert overlap.step_ms_alone > 0 and overlap.step_ms_beside_copy > 0
    assert overlap.copy_bytes_per_s_beside > 0 and overlap.slowdown >= 1.0
    assert "beside" in overlap.describe()
    assert not engine.has_unfinished_requests()
    # The copies went to the host tier: some of its blocks now hold the device's marked KV.
    assert int((cache.host_k == 0.5).all(dim=(0, 1, 3, 4)).sum()) > 0
    # No host tier: nothing to copy, nothing measured.
    no_host = LLMEngine(EngineConfig(model=ModelLoadConfig(model=str(ckpt)),
                                     cache=CacheConfig(kv_cache_tokens=2048, swap_space_tokens=0)).validate())
    assert measure_swap_overlap(no_host) is None


def test_a_forward_faster_beside_a_copy_is_not_a_speed_up() -> None:
    # Noise can time the step beside the copy a little faster; a copy never speeds the forward.
    assert OverlapProfile(10.0, 9.5, 1e9).slowdown == 1.0
    assert OverlapProfile(10.0, 16.0, 1e9).slowdown == pytest.approx(1.6)


def test_the_overlap_fields_average_and_round_trip(tmp_path) -> None:
    a = CostModel(swap_compute_slowdown=1.5, swap_bytes_per_s_beside_compute=1e9)
    b = CostModel(swap_compute_slowdown=2.5, swap_bytes_per_s_beside_compute=3e9)
    mean = mean_cost_model(a, b, "m")
    assert mean.swap_compute_slowdown == pytest.approx(2.0) and mean.swap_bytes_per_s_beside_compute == 2e9
    a.save(tmp_path / "a.json")
    assert CostModel.load(tmp_path / "a.json") == a


def test_the_engine_compares_its_steps_with_the_cost_model(tmp_path) -> None:
    # What the simulator would charge each executed step, summed beside the time the steps took:
    # their ratio is what `segue sim --step-time-scale` replays.
    from conftest import make_tiny_checkpoint
    from segue.sampling_params import SamplingParams
    from segue.sched.step_charge import step_seconds

    ckpt = make_tiny_checkpoint(tmp_path / "tiny")
    engine = LLMEngine(EngineConfig(model=ModelLoadConfig(model=str(ckpt)),
                                    cache=CacheConfig(kv_cache_tokens=2048, swap_space_tokens=0)).validate())
    executed = []
    inner = engine.executor.execute

    def execute(out):
        executed.append(out)
        return inner(out)

    engine.executor.execute = execute
    engine.add_request(EngineRequest(list(range(5, 40)), SamplingParams(max_tokens=4, temperature=0, ignore_eos=True),
                                     "acct"))
    while engine.has_unfinished_requests():
        engine.step()
    stats = engine.stats()
    cost, bs = engine.scheduler.state.cost, engine.scheduler.state.kv.block_size
    assert stats.steps == len(executed) == 4  # the prefill, then three decodes
    assert stats.step_seconds > 0
    assert stats.modelled_step_seconds == pytest.approx(sum(step_seconds(cost, out, bs)[0] for out in executed))
    assert stats.modelled_step_seconds > 0


def test_a_scaled_model_runs_its_compute_slower_and_its_copies_as_fast() -> None:
    from segue.sched.cost_model import PRESETS, load_preset

    base = PRESETS["gptj-6b-a100"]
    slow = load_preset("gptj-6b-a100", 1.5)
    assert slow.t_step(512, 4096, 10**6, 20) == pytest.approx(1.5 * base.t_step(512, 4096, 10**6, 20))
    assert slow.t_swap(1000) == base.t_swap(1000)
    assert load_preset("gptj-6b-a100") is base
    with pytest.raises(ValueError):
        base.scaled(0)
    with pytest.raises(SystemExit):
        load_preset("no-such-preset")
