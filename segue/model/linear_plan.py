"""How a model's linear layers run, as one value: the quantization, up to how many rows the
quantized kernels run before a GEMM over the dequantized weights takes over, the rows padded to
a faster count, the rows GGUF blocks run for; the same for the LM head, which has its own.

The executor's KernelPlan (executor/kernel_plan.py) measures these; LlamaModel takes them here so
that its constructor reads by name and the model layer needs nothing of the executor's."""
from __future__ import annotations

from dataclasses import dataclass

from segue.model.quant import Quantization


@dataclass(frozen=True)
class LinearPlan:
    quantization: Quantization = Quantization.NONE
    # With a quantization, batches of more rows than this run a GEMM over the dequantized weights.
    dense_above: int = 16
    # Row counts padded up to one the kernels run faster (measured), or None.
    padded_rows: dict[int, int] | None = None
    # Up to how many rows a GGUF file's blocks run their own kernels (0: never), and the blocks'
    # layout in memory ("file" or "rows16": model/gguf_blocks.py's BlockLayout).
    block_rows: int = 0
    block_layout: str = "file"
    # The LM head's: None is int8 for int4 layers, else the layers' quantization.
    head_quantization: Quantization | None = None
    head_dense_above: int = 16
    head_padded_rows: dict[int, int] | None = None
    head_block_rows: int = 0
    head_block_layout: str = "file"
    # "packed" or "dense" (model/gguf_blocks.py's WeightsMemory): whether blocks keep a dense copy.
    weights_memory: str = "packed"
