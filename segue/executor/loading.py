"""From an engine config to what the engine runs on: the model executor with its tokenizer and
chat template, and the step-cost model the scheduler plans with."""
from __future__ import annotations

from typing import Any, NamedTuple

from segue.config import EngineConfig
from segue.executor.base import Executor
from segue.sched.cost_model import CostModel, default_profile_path


class LoadedModel(NamedTuple):
    """A loaded checkpoint on its executor. Several engines (a benchmark's configurations) can share
    one: each gets its own scheduler and KV manager over the same executor."""
    executor: Executor
    tokenizer: Any
    model_config: Any
    model_name: str
    chat_template: str | None


def load_model(config: EngineConfig) -> LoadedModel:
    import torch

    from segue.executor.kernel_plan import DTYPES, plan_kernels, resolve_device
    from segue.executor.model_executor import ModelExecutor
    from segue.model.loader import load_checkpoint

    if config.num_threads:
        torch.set_num_threads(config.num_threads)
    device = resolve_device(config.model.device)
    kernels = None
    if device.type == "cpu":
        from segue.model.cpu_kernels import load_cpu_kernels
        kernels = load_cpu_kernels()
    # Loaded in full precision unless both choices are fixed: quantized weights are made from
    # full-precision ones, not from a bf16-rounded copy, and "auto" is decided after loading.
    fixed = config.model.dtype != "auto" and config.model.quantization == "none"
    ckpt = load_checkpoint(config.model.model, dtype=DTYPES[config.model.dtype] if fixed else torch.float32)
    plan = plan_kernels(config.model, ckpt.config, device, kernels, ckpt.weights)
    executor = ModelExecutor(ckpt, config.cache, device, plan, kernels)
    return LoadedModel(executor, ckpt.tokenizer, ckpt.config, ckpt.name, ckpt.chat_template)


def engine_cost_model(config: EngineConfig, executor: Executor) -> CostModel:
    """The configured profile, else this device's saved `segue profile` output, else the built-in
    defaults; the KV bytes per token always come from the executor's real cache."""
    device = getattr(executor, "device_name", "cpu")
    path = config.scheduler.profile_path or default_profile_path(device)
    try:
        cost = CostModel.load(path)
    except FileNotFoundError:
        if config.scheduler.profile_path:
            raise  # a profile the user named must exist
        cost = CostModel(device=device)
    kv_bytes = getattr(executor, "kv_bytes_per_token", None)
    if kv_bytes:
        cost.kv_bytes_per_token = kv_bytes
    return cost
