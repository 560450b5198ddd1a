"""The dtype, weight format and per-batch-size kernels an executor runs, resolved from the
configuration and, on CPU, from this machine's measured kernel table (segue/model/kernel_table.py)."""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from segue.config import ConfigError, ModelLoadConfig
from segue.model.config import ModelConfig
from segue.model.quant import Quantization

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class KernelPlan:
    dtype: torch.dtype
    quantization: Quantization
    # Quantized layers run batches of at most this many rows through the quantized kernel, larger
    # ones through a GEMM over the dequantized weight (0: never quantized); the same for the LM head.
    quantized_rows: int = 0
    head_quantized_rows: int = 0


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def plan_kernels(load: ModelLoadConfig, config: ModelConfig, device: torch.device,
                 kernels: object | None) -> KernelPlan:
    """CUDA: bf16 for "auto", no quantization (no fast kernel wired there). CPU: "auto" follows
    the kernel table (the dtype first, then int8 where it beats that dtype's GEMM), and so do the
    row ranges of an explicit quantization. Without native kernels a quantization would only
    dequantize (worse numbers, no speed), so "auto" is none."""
    if device.type != "cpu" and not load.batch_invariant:
        dtype = torch.bfloat16 if load.dtype == "auto" else _DTYPES[load.dtype]
        quant = Quantization.NONE if load.quantization == "auto" else Quantization(load.quantization)
        return KernelPlan(dtype, quant)
    if load.batch_invariant:
        return _batch_invariant_plan(load, device, kernels)
    from segue.model.kernel_table import kernel_table

    table = kernel_table(config, kernels)
    dtype_name = table.dense_dtype() if load.dtype == "auto" else load.dtype
    # float16 has no measured row: its GEMMs compare like bfloat16's on every CPU torch supports.
    dense = dtype_name if dtype_name in ("float32", "bfloat16") else "bfloat16"
    if load.quantization == "auto":
        # Only under float32: bf16 activations over int8 weights fell below the quality bar on
        # the default model (96.2% greedy agreement, tests/test_quantization.py).
        wins = kernels is not None and dense == "float32" and (
            table.quantized_up_to("layers", "int8", dense) > 0 or table.quantized_up_to("lm_head", "int8", dense) > 0)
        quant = Quantization.INT8 if wins else Quantization.NONE
    else:
        quant = Quantization(load.quantization)
    rows = head_rows = 0
    if quant is not Quantization.NONE and kernels is not None:
        rows = table.quantized_up_to("layers", quant.value, dense)
        # int4 keeps the LM head in int8 (segue/model/llama.py).
        head_rows = table.quantized_up_to("lm_head", "int8", dense)
    plan = KernelPlan(_DTYPES[dtype_name], quant, rows, head_rows)
    logger.info("kernels: %s, %s weights up to %d rows (LM head %d), from the kernel table of %s",
                dtype_name, quant.value, rows, head_rows, table.key.get("cpu"))
    return plan


# Larger than any batch: the quantized kernels take every row.
_EVERY_BATCH = 1 << 30


def _batch_invariant_plan(load: ModelLoadConfig, device: torch.device, kernels: object | None) -> KernelPlan:
    """The native quantized kernels at every batch size: each output row is summed in the same
    order whatever the other rows (segue/model/csrc/quant_ops.cpp), as are the attention kernels'
    rows, so nothing in a request's forward depends on the batch."""
    if device.type != "cpu" or kernels is None:
        raise ConfigError("batch_invariant needs the native CPU kernels (a CPU device with a working compiler)")
    if load.quantization == "none":
        raise ConfigError("batch_invariant runs the quantized native kernels at every batch size: "
                          "use quantization auto, int8 or int4")
    quant = Quantization.INT4 if load.quantization == "int4" else Quantization.INT8
    # The kernels accumulate in fp32; bf16 activations would only add a rounding per layer.
    dtype = torch.float32 if load.dtype == "auto" else _DTYPES[load.dtype]
    return KernelPlan(dtype, quant, _EVERY_BATCH, _EVERY_BATCH)
