"""The simulated engine: the real LLMEngine (scheduler, KV manager, policies) over a SimExecutor
whose step cost comes from a CostModel and whose clock is virtual. Built here, above both the
engine and the executors, so neither imports the other."""
from __future__ import annotations

import copy
import os
import tempfile

from segue.config import EngineConfig
from segue.engine import LLMEngine
from segue.executor.sim_executor import SimClock, SimExecutor, SimTokenizer, sim_model_config
from segue.sched.cost_model import CostModel


def make_sim_engine(cost: CostModel, kv_cache_tokens: int, config: EngineConfig | None = None,
                    max_model_len: int = 4096, swap_space_tokens: int | None = None,
                    clock: SimClock | None = None) -> LLMEngine:
    """An LLMEngine over a SimExecutor whose clock is virtual. `config` supplies the scheduler
    knobs and block size; its cache sizes are replaced by `kv_cache_tokens` and
    `swap_space_tokens` (default: the config's), and the scheduler reasons with `cost`."""
    config = copy.deepcopy(config) if config is not None else EngineConfig()
    bs = config.cache.block_size
    config.cache.kv_cache_tokens = kv_cache_tokens
    config.cache.kv_cache_bytes = None
    if swap_space_tokens is not None:
        config.cache.swap_space_tokens = swap_space_tokens
    clock = clock or SimClock()
    sim = SimExecutor(cost, kv_cache_tokens // bs, config.cache.swap_space_tokens // bs, bs, clock)
    # The engine takes its cost model from a profile file; handing it one keeps the engine
    # unchanged and guarantees the scheduler plans with the same costs the executor charges.
    fd, path = tempfile.mkstemp(prefix="segue-sim-cost-", suffix=".json")
    os.close(fd)
    try:
        cost.save(path)
        config.scheduler.profile_path = path
        engine = LLMEngine(config, executor=sim, tokenizer=SimTokenizer(),
                           model_config=sim_model_config(max_model_len), model_name=f"sim-{cost.device}")
    finally:
        os.unlink(path)
    config.scheduler.profile_path = None
    engine.clock = clock
    return engine
