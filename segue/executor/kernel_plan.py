"""The dtype, weight format and per-batch-size kernels an executor runs, resolved from the
configuration and, on CPU, from this machine's measured kernel table (segue/model/kernel_table.py)."""
from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from types import ModuleType

import torch

from segue.config import ConfigError, ModelLoadConfig
from segue.model.config import ModelConfig
from segue.model.gguf_blocks import GGMLBlocks, WeightsMemory
from segue.model.quant import EVERY_BATCH, Quantization, dequantize_int4, dequantize_int8, quantize_int4, quantize_int8

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class KernelPlan:
    dtype: torch.dtype
    quantization: Quantization
    # Quantized layers run batches of at most this many rows through the quantized kernel, larger
    # ones through a GEMM over the dequantized weight (0: never quantized); the same for the LM head.
    quantized_rows: int = 0
    head_quantized_rows: int = 0
    head_quantization: Quantization | None = None  # None: int8 under int4 layers, else the layers'
    # The GEMMs' timed row counts, each with the count it runs fastest at (padded with zero rows).
    padded_rows: tuple[tuple[int, int], ...] = ()
    head_padded_rows: tuple[tuple[int, int], ...] = ()
    # Every row of a step runs the same kernels whatever the others (ModelExecutor: attention too).
    batch_invariant: bool = False
    # A GGUF file's matrices kept as blocks (segue/model/gguf_blocks.py): batches of at most this
    # many rows run the block kernels, larger ones a GEMM over the dense weight; the same for the
    # LM head. `weights_memory` "dense" keeps that dense weight, "packed" dequantizes it per call.
    block_rows: int = 0
    head_block_rows: int = 0
    weights_memory: str = "packed"
    # How the blocks lie in memory ("file" or "rows16", measured: model/gguf_table.py).
    block_layout: str = "file"
    head_block_layout: str = "file"


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def lossless_formats(weights: Mapping[str, torch.Tensor], config: ModelConfig) -> tuple[set[str], set[str]]:
    """The quantized formats that hold the checkpoint's matrices exactly (a GGUF Q4_1 or Q8_0
    file's, dequantized), for the layers and for the LM head. Checked on every projection of the
    first and last layer (q, k and v are fused into one matrix, gate and up into another: a
    format must hold each): GGUF files quantize a tensor kind alike across layers."""
    def exact(w: torch.Tensor) -> set[str]:
        w = w.float()
        tol = 1e-5 * float(w.abs().max()) + 1e-12
        found = set()
        if w.shape[1] % 32 == 0:
            if float((dequantize_int8(*quantize_int8(w)) - w).abs().max()) <= tol:
                found.add("int8")
            if float((dequantize_int4(*quantize_int4(w)) - w).abs().max()) <= tol:
                found.add("int4")
        return found

    layers: set[str] | None = None
    for i in {0, config.num_layers - 1}:
        for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                     "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"):
            w = weights.get(f"model.layers.{i}.{name}.weight")
            found = exact(w) if w is not None else set()
            layers = found if layers is None else layers & found
    head = weights.get("model.embed_tokens.weight" if config.tie_word_embeddings else "lm_head.weight")
    return layers or set(), exact(head) if head is not None else set()


def plan_kernels(load: ModelLoadConfig, config: ModelConfig, device: torch.device, kernels: ModuleType | None,
                 weights: Mapping[str, torch.Tensor | GGMLBlocks] | None = None) -> KernelPlan:
    """CUDA: bf16 for "auto", no quantization (no fast kernel wired there). CPU: "auto" follows
    the kernel table: the dtype first, then a quantized kernel for the batch sizes where it beats
    that dtype's GEMM, only in a format that holds the checkpoint exactly (`weights`: a GGUF
    Q4_1 / Q8_0 file's): as in vLLM, a checkpoint's numbers change only when the user asks.
    An explicit quantization runs where the table says it wins. Without native kernels a
    quantization would only dequantize (worse numbers, no speed), so "auto" is none."""
    if load.batch_invariant:
        return _batch_invariant_plan(load, config, device, kernels, weights)
    if weights is not None and any(isinstance(w, GGMLBlocks) for w in weights.values()):
        return _block_plan(load, config, kernels, weights)
    quant_fixed = load.quantization == "none" or (kernels is None and load.quantization != "auto")
    if device.type != "cpu" or (load.dtype != "auto" and quant_fixed):
        # Nothing left for a CPU kernel table to decide: no table is measured.
        dtype = torch.bfloat16 if load.dtype == "auto" else DTYPES[load.dtype]
        quant = Quantization.NONE if load.quantization == "auto" else Quantization(load.quantization)
        return KernelPlan(dtype, quant)
    from segue.model.kernel_table import kernel_table

    dense_weights = {n: w for n, w in (weights or {}).items() if isinstance(w, torch.Tensor)}
    exact_layers, exact_head = lossless_formats(dense_weights, config) \
        if weights is not None and load.quantization == "auto" else (set(), set())
    if load.quantization == "auto":
        wanted = tuple(sorted(exact_layers | ({"int8"} & exact_head)))
    else:
        wanted = () if load.quantization == "none" else tuple(sorted({load.quantization, "int8"}))
    table = kernel_table(config, kernels, quants=wanted)
    dtype_name = table.dense_dtype() if load.dtype == "auto" else load.dtype
    # float16 has no measured row: its GEMMs compare like bfloat16's on every CPU torch supports.
    dense = dtype_name if dtype_name in ("float32", "bfloat16") else "bfloat16"
    if kernels is None:
        quant = Quantization.NONE if load.quantization == "auto" else Quantization(load.quantization)
        return KernelPlan(DTYPES[dtype_name], quant)
    if load.quantization == "auto":
        # The exact format with the widest winning row range.
        ranked = sorted(exact_layers, key=lambda f: (table.quantized_up_to("layers", f, dense), f))
        quant = Quantization(ranked[-1]) if ranked and table.quantized_up_to("layers", ranked[-1], dense) else \
            Quantization.NONE
        head_quant = Quantization.INT8 if "int8" in exact_head else Quantization.NONE
    else:
        quant = Quantization(load.quantization)
        head_quant = Quantization.NONE if quant is Quantization.NONE else Quantization.INT8
    rows = table.quantized_up_to("layers", quant.value, dense) if quant is not Quantization.NONE else 0
    head_rows = table.quantized_up_to("lm_head", "int8", dense) if head_quant is not Quantization.NONE else 0
    if not head_rows:
        head_quant = Quantization.NONE
    padded = tuple(table.padded_rows("layers", dense).items())
    head_padded = tuple(table.padded_rows("lm_head", dense).items())
    plan = KernelPlan(DTYPES[dtype_name], quant, rows, head_rows, head_quant, padded, head_padded)
    pads = ", ".join(f"{a}->{b}" for a, b in padded if b != a) or "none"
    logger.info("kernels: %s; %s layers up to %d rows, %s LM head up to %d rows, GEMM rows padded: %s "
                "(the kernel table of %s)", dtype_name, quant.value, rows, head_quant.value, head_rows, pads,
                table.key.get("cpu"))
    return plan


def _block_plan(load: ModelLoadConfig, config: ModelConfig, kernels: ModuleType | None,
                weights: Mapping[str, object]) -> KernelPlan:
    """A GGUF file kept as blocks: the dtype from the GEMM table (it runs the larger batches and
    the activations), the block kernels up to the row counts where this machine's block table
    measured them not slower than the GEMM they stand against."""
    from segue.model.cpu_kernels import load_gguf_kernels
    from segue.model.gguf_table import block_table
    from segue.model.kernel_table import kernel_table

    gguf = load_gguf_kernels()
    if gguf is None:
        raise ConfigError("GGUF blocks were kept but the GGUF kernels are not built")
    gemms = kernel_table(config, kernels, quants=()) if load.dtype == "auto" else None
    dtype_name = gemms.dense_dtype() if gemms is not None else load.dtype
    dense = dtype_name if dtype_name in ("float32", "bfloat16") else "bfloat16"
    # For matrices of a type the block kernels do not read (LinearWeights over dequantized ones).
    padded = tuple(gemms.padded_rows("layers", dense).items()) if gemms is not None else ()
    memory = WeightsMemory(load.weights_memory)
    table = block_table(config, weights, DTYPES[dtype_name], gguf, memory)
    other = "dense" if memory is WeightsMemory.DENSE else "dequant"
    rows = table.block_rows("layers", other) if "layers" in table.timings_ms else 0
    head_rows = table.block_rows("lm_head", other) if "lm_head" in table.timings_ms else 0
    layout = table.layout("layers").value if "layers" in table.timings_ms else "file"
    head_layout = table.layout("lm_head").value if "lm_head" in table.timings_ms else "file"
    blocks = [w for w in weights.values() if isinstance(w, GGMLBlocks)]
    counts = Counter(w.type_name for w in blocks)
    logger.info("kernels: %s; GGUF blocks (%s, %.0f MiB) up to %d rows, LM head up to %d rows; block layout: "
                "layers %s, LM head %s; larger batches: a GEMM over %s (--weights-memory %s; the block table of %s)",
                dtype_name, ", ".join(f"{n} {t}" for t, n in sorted(counts.items())),
                sum(b.nbytes for b in blocks) / 2**20, rows, head_rows, layout, head_layout,
                "a dense copy" if memory is WeightsMemory.DENSE else "the layer dequantized per call",
                memory.value, table.key.get("cpu"))
    return KernelPlan(DTYPES[dtype_name], Quantization.NONE, padded_rows=padded, block_rows=rows,
                      head_block_rows=head_rows, weights_memory=memory.value, block_layout=layout,
                      head_block_layout=head_layout)


def _batch_invariant_plan(load: ModelLoadConfig, config: ModelConfig, device: torch.device,
                          kernels: ModuleType | None,
                          weights: Mapping[str, torch.Tensor | GGMLBlocks] | None = None) -> KernelPlan:
    """The native quantized kernels at every batch size: each output row is summed in the same
    order whatever the other rows (segue/model/csrc/quant_ops.cpp), as are the fused ops' rows;
    the executor runs every row through one attention kernel in position order (ModelExecutor.
    _invariant_attention). So nothing in a request's forward depends on the batch, its chunking,
    its block ids or a prefix-cache hit, to the bit (tests/engine/test_batch_invariant.py)."""
    if device.type != "cpu" or kernels is None:
        raise ConfigError("batch_invariant needs the native CPU kernels (a CPU device with a working compiler)")
    if load.quantization == "none":
        raise ConfigError("batch_invariant runs the quantized native kernels at every batch size: "
                          "use quantization auto, int8 or int4")
    quant = Quantization.INT4 if load.quantization == "int4" else Quantization.INT8
    head = Quantization.INT8
    if load.quantization == "auto" and weights is not None:
        # A checkpoint a format holds exactly (the default model's Q4_1 layers) runs in that
        # format: re-quantizing it to int8 would change its numbers.
        dense = {n: w for n, w in weights.items() if isinstance(w, torch.Tensor)}
        exact_layers, exact_head = lossless_formats(dense, config)
        if exact_layers:
            quant = Quantization.INT8 if "int8" in exact_layers else Quantization.INT4
        if exact_head:
            head = Quantization.INT8 if "int8" in exact_head else Quantization.INT4
    # The kernels accumulate in fp32; bf16 activations would only add a rounding per layer.
    dtype = torch.float32 if load.dtype == "auto" else DTYPES[load.dtype]
    return KernelPlan(dtype, quant, EVERY_BATCH, EVERY_BATCH, head, batch_invariant=True)
