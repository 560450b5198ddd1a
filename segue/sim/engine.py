"""The simulated engine: the real LLMEngine (scheduler, KV manager, policies) over a SimExecutor
whose step cost comes from a CostModel and whose clock is virtual. Built here, above both the
engine and the executors, so neither imports the other."""
from __future__ import annotations

import copy
import os
import tempfile

from segue.config import EngineConfig, SchedulerConfig
from segue.engine.llm_engine import LLMEngine
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


def step_limits(max_num_batched_tokens: int | None, max_num_seqs: int | None, cost: CostModel,
                serves: bool) -> tuple[int, int]:
    """The step budget and sequence limit of a simulation, where its flags leave them unsaid: the
    server's defaults for a run that stands for `segue serve` (`serves`), else the preset's
    saturation point and vLLM's 256 sequences (InferCept's setting)."""
    if serves:
        return (max_num_batched_tokens or SchedulerConfig.max_num_batched_tokens,
                max_num_seqs or SchedulerConfig.max_num_seqs)
    return max_num_batched_tokens or cost.saturation_tokens, max_num_seqs or 256


# Device KV pool assumed for each preset: vLLM's default gpu_memory_utilization (0.9) of the
# GPUs' memory minus fp16 weights; activations and the CUDA context come out of the 10%.
#   gptj-6b-a100, 80 GiB:      0.9 * 80 GiB - 6.05e9 params * 2 B = 65.2 GB / 458,752 B per token
#   vicuna-13b-2xa100, 80 GiB: 0.9 * 2 * 80 GiB - 13.0e9 * 2 B   = 128.6 GB / 819,200 B per token
# InferCept itself ran on AWS p4d (A100 40 GB, as LAMPS infers): --gpu-memory-gib 40.
_GPUS_AND_PARAMS = {"gptj-6b-a100": (1, 6.05e9), "vicuna-13b-2xa100": (2, 13.0e9)}


def default_kv_cache_tokens(preset: str, kv_bytes_per_token: int, block_size: int,
                            gpu_gib: float = 80.0) -> int | None:
    if preset not in _GPUS_AND_PARAMS:
        return None
    gpus, params = _GPUS_AND_PARAMS[preset]
    tokens = int((0.9 * gpus * gpu_gib * 2**30 - 2 * params) // kv_bytes_per_token)
    return tokens // block_size * block_size
