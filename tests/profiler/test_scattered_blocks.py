"""Decode attention over scattered blocks: the cost term, what a step counts, what the simulator
charges, and the profiler's measurement of it on a tiny model."""
from __future__ import annotations

import random

import pytest

from segue.config import CacheConfig, EngineConfig, ModelLoadConfig
from segue.engine.llm_engine import LLMEngine
from segue.executor.sim_executor import SimClock, SimExecutor
from segue.profiler.scatter import RUN, measure_scatter
from segue.request import Request
from segue.sampling_params import SamplingParams
from segue.sched.cost_model import CostModel, mean_cost_model, scattered_blocks
from segue.sched.output import ScheduledSeq, SchedulerOutput


def test_scattered_blocks_counts_cold_blocks_beyond_one_piece() -> None:
    assert scattered_blocks(list(range(40)), 4) == 0          # one piece: the baseline
    assert scattered_blocks(list(range(40))[::-1], 4) == 0     # read in id order, so reversed is one piece too
    assert scattered_blocks([0, 2, 4, 6, 8], 4) == 5 - 4       # five runs of one, minus the baseline's four
    assert scattered_blocks([0, 1, 2, 10, 11, 12, 13, 14, 15, 30], 4) == (3 + 4 + 1) - 4
    assert scattered_blocks([5, 9], 4) == 0                    # a piece of two warms up no more than two
    assert scattered_blocks([0, 2, 4], 0) == 0                 # no warm-up profiled: no term
    ids = random.Random(0).sample(range(1000), 64)
    assert scattered_blocks(ids, 4) == scattered_blocks(sorted(ids), 4) > 0


def _seq(i: int, tokens: int, start: int, table: list[int]) -> ScheduledSeq:
    req = Request(f"r{i}", [7] * (start + tokens), SamplingParams(max_tokens=4), 0.0)
    return ScheduledSeq(req, [7] * tokens, start, table, True)


def test_a_step_counts_its_decodes_scattered_blocks_only() -> None:
    scattered = [0, 2, 4, 6, 8, 10]
    # Context 64 at block size 16: the decode reads 4 blocks (its table's fifth and sixth are not read yet).
    decode = _seq(0, 1, 63, scattered)
    prefill = _seq(1, 32, 0, scattered)
    out = SchedulerOutput([decode, prefill, _seq(2, 1, 63, [20, 21, 22, 23])])
    assert out.num_scattered_blocks(16, 2) == scattered_blocks([0, 2, 4, 6], 2) == 2
    assert out.num_scattered_blocks(16, 0) == 0


def test_the_simulator_charges_scattered_blocks() -> None:
    cost = CostModel(fwd_ms_per_token=1.0, fwd_base_ms=10.0, fwd_ms_per_scattered_block=0.5,
                     prefetch_warmup_blocks=2)
    ex = SimExecutor(cost, 100, 0, 16, SimClock())
    one_piece = SchedulerOutput([_seq(0, 1, 63, [0, 1, 2, 3])])
    scattered = SchedulerOutput([_seq(0, 1, 63, [0, 20, 40, 60])])
    assert ex.step_seconds(scattered)[0] - ex.step_seconds(one_piece)[0] == pytest.approx(2 * 0.5 / 1000)
    assert cost.t_step(4, 100, 100, scattered=3) - cost.t_step(4, 100, 100) == pytest.approx(1.5 / 1000)
    mean = mean_cost_model(cost, CostModel(fwd_ms_per_scattered_block=1.5, prefetch_warmup_blocks=2), "m")
    assert mean.fwd_ms_per_scattered_block == pytest.approx(1.0) and mean.prefetch_warmup_blocks == 2


def test_profile_measures_scatter_on_a_real_pool(tmp_path) -> None:
    from conftest import make_tiny_checkpoint

    ckpt = make_tiny_checkpoint(tmp_path / "tiny")
    engine = LLMEngine(EngineConfig(model=ModelLoadConfig(model=str(ckpt)),
                                    cache=CacheConfig(kv_cache_tokens=2048, swap_space_tokens=0)).validate())
    scatter = measure_scatter(engine, repeats=2)
    assert scatter is not None
    assert set(scatter.step_ms) == {"one piece", "shuffled", f"runs of {RUN}"}
    assert all(ms > 0 for ms in scatter.step_ms.values())
    # A tiny model's cache fits the CPU's caches, so the measured cost may well be nothing; either
    # way the pair is consistent.
    assert (scatter.ms_per_scattered_block > 0) == (scatter.warmup_blocks > 0)
    assert 0 <= scatter.warmup_blocks <= RUN
    assert "cold block" in scatter.describe()
    assert not engine.has_unfinished_requests()
    # A pool too small for the layouts is not measured.
    small = LLMEngine(EngineConfig(model=ModelLoadConfig(model=str(ckpt)),
                                   cache=CacheConfig(kv_cache_tokens=256, swap_space_tokens=0)).validate())
    assert measure_scatter(small) is None
