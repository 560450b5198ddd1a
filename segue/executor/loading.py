"""From an engine config to what the engine runs on: the model executor with its tokenizer and
chat template, and the step-cost model the scheduler plans with."""
from __future__ import annotations

import hashlib
import json
import logging
import time
from pathlib import Path
from typing import Any, NamedTuple

from segue.config import EngineConfig
from segue.executor.base import Executor
from segue.sched.cost_model import CostModel

logger = logging.getLogger(__name__)


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
    t0 = time.perf_counter()
    ckpt = load_checkpoint(config.model.model, dtype=DTYPES[config.model.dtype] if fixed else torch.float32,
                           keep_blocks=keep_blocks(config, device))
    # Where a start's own work ends and planning begins: measured tables, when not cached, come next.
    logger.info("weights loaded: %s in %.1f s", ckpt.name, time.perf_counter() - t0)
    plan = plan_kernels(config.model, ckpt.config, device, kernels, ckpt.weights)
    executor = ModelExecutor(ckpt, config.cache, device, plan, kernels, config.model.attention_backend)
    return LoadedModel(executor, ckpt.tokenizer, ckpt.config, ckpt.name, ckpt.chat_template)


def keep_blocks(config: EngineConfig, device: object) -> bool:
    """Whether a GGUF file's quantized matrices may stay as blocks (where the block kernels
    build): on CPU, unless a quantization was asked for (it re-quantizes from dequantized
    weights) or a batch-invariant run (its one kernel per op is the int8/int4 one)."""
    return getattr(device, "type", None) == "cpu" and config.model.quantization == "auto" and \
        not config.model.batch_invariant


def profile_key(config: EngineConfig, executor: Executor) -> dict[str, str]:
    """What a `segue profile`'s step times depend on, keyed as the kernel table is: the CPU (its
    model and flags; it also drives a GPU), the device, the checkpoint and its shapes, the dtype
    and quantization the plan chose, the KV cache's dtype and block size (decode attention reads
    every cached row, in blocks), batch invariance (it runs other kernels at every size), the
    attention backend asked for, the threads and torch. Loaded under another of these, a profile
    charges steps this engine does not run, and the scheduler plans by them."""
    import torch

    from segue.model import kernel_table

    model = getattr(executor, "config", None)
    shapes = "unknown" if model is None else ",".join(map(str, (
        model.hidden_size, model.intermediate_size, model.num_layers, model.num_heads, model.num_kv_heads,
        model.head_dim, model.vocab_size)))
    name = config.model.model
    return {**kernel_table.cpu_identity(), "device": getattr(executor, "device_name", "cpu"),
            "checkpoint": str(Path(name).resolve()) if name and Path(name).exists() else name or "default",
            "shapes": shapes, "dtype": str(getattr(executor, "dtype", "")),
            "quantization": str(getattr(getattr(executor, "quantization", ""), "value", "")),
            "kv_dtype": str(getattr(executor, "kv_dtype", config.cache.kv_cache_dtype)),
            "block_size": str(getattr(executor, "block_size", config.cache.block_size)),
            "batch_invariant": str(config.model.batch_invariant), "attention": config.model.attention_backend,
            "threads": str(torch.get_num_threads()), "torch": torch.__version__}


def profile_path(key: dict[str, str]) -> Path:
    """Where the profile of this key is saved and looked for, beside the kernel tables (under
    SEGUE_CACHE_DIR when set)."""
    from segue.model.table_cache import cache_dir

    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
    return cache_dir().parent / "profiles" / f"profile-{key['device']}-{digest}.json"


def engine_cost_model(config: EngineConfig, executor: Executor) -> CostModel:
    """The configured profile, else the saved `segue profile` output of this machine, model and
    thread count, else the built-in defaults; the KV bytes per token always come from the
    executor's real cache."""
    device = getattr(executor, "device_name", "cpu")
    path = config.scheduler.profile_path or profile_path(profile_key(config, executor))
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
