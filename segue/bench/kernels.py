"""`segue bench kernels`: this machine's kernel tables for a model (measured now if not cached)
and the plan the engine derives from them: the dtype, up to how many rows each op runs the
quantized kernel, and which attention backend runs each kind and length of attention. See
segue/model/kernel_table.py and segue/model/attention_table.py.

The tables are a CPU's: on CUDA the plan is fixed (bf16, no quantization, nothing measured). On a
machine where torch sees a GPU, `--device auto` (what `make setup` runs) resolves to CUDA; the
benchmark then measures the CPU's tables all the same (what `--device cpu` serves with) and says
so, instead of failing the setup of a GPU host."""
from __future__ import annotations

import argparse
import json

from segue.bench import Benchmark


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--remeasure", action="store_true", help="measure again even if a table is cached")
    p.add_argument("--output-json", default=None, help="write the table and the plan as JSON")


CUDA_PLAN = "bf16, no quantization: nothing to measure"


def table_device(name: str) -> tuple[str, str | None]:
    """The device whose tables are measured (always "cpu") and, when the engine would run on
    another one for `--device name`, a line saying so."""
    from segue.executor.kernel_plan import resolve_device

    device = resolve_device(name)
    if device.type == "cpu":
        return "cpu", None
    return "cpu", (f"--device {name} runs on {device.type} here, whose plan is fixed ({CUDA_PLAN}); "
                   "these are the CPU's tables, used with --device cpu")


def run(args: argparse.Namespace) -> int:
    import torch

    from segue.engine.args import engine_config_from_args
    from segue.executor.kernel_plan import DTYPES, plan_kernels
    from segue.model import attention_table as at
    from segue.model import kernel_table as kt
    from segue.model.cpu_kernels import load_cpu_kernels
    from segue.model.fused_table import fused_table
    from segue.model.loader import load_checkpoint

    config = engine_config_from_args(args)
    if config.num_threads:
        torch.set_num_threads(config.num_threads)
    measured, note = table_device(config.model.device)
    if note is not None:
        print(note)
    device = torch.device(measured)
    kernels = load_cpu_kernels()
    from segue.executor.loading import keep_blocks

    # As the engine loads it: a GGUF file's blocks kept, so its block table is measured here too.
    ckpt = load_checkpoint(config.model.model, keep_blocks=keep_blocks(config, device))
    model = ckpt.config
    # Remeasured (and saved where the engine looks) with every format, so the table is complete.
    table = kt.kernel_table(model, kernels, remeasure=args.remeasure)
    plan = plan_kernels(config.model, model, device, kernels, ckpt.weights)
    kv_dtype = plan.dtype if config.cache.kv_cache_dtype == "auto" else DTYPES[config.cache.kv_cache_dtype]
    layout = at.HeadLayout.of(model, plan.dtype, kv_dtype)
    attention = at.attention_table(layout, kernels, device, remeasure=args.remeasure)
    fused = fused_table(model, plan.dtype, kv_dtype, kernels, remeasure=args.remeasure) if kernels else None
    print(f"CPU tables: {table.key['cpu']} (flags {table.key['flags']}), {table.key['threads']} threads, "
          f"torch {table.key['torch']}, kernels {table.key['kernels']}")
    noisy = "\n(measured on a noisy machine: where a difference stayed within the noise the default runs; " \
        "--remeasure measures again)"
    print(table.format() + (noisy if table.noisy else ""))
    print(f"attention at {layout.num_heads} query / {layout.num_kv_heads} KV heads of {layout.head_dim}, "
          f"{str(layout.dtype).removeprefix('torch.')} (cache {str(kv_dtype).removeprefix('torch.')}):")
    print(attention.format())
    if fused is not None:
        print(fused.format())
    print(f"CPU plan for --dtype {config.model.dtype} --quantization {config.model.quantization}: "
          f"{str(plan.dtype).removeprefix('torch.')}; {plan.quantization.value} layers up to "
          f"{plan.quantized_rows} rows, {(plan.head_quantization or plan.quantization).value} LM head up to "
          f"{plan.head_quantized_rows} rows" + (f"; GGUF blocks up to {plan.block_rows} rows, LM head up to "
                                                f"{plan.head_block_rows}" if plan.block_rows or plan.head_block_rows
                                                else ""))
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"table": json.loads(table.to_json()), "attention": json.loads(attention.to_json()),
                       "fused": json.loads(fused.to_json()) if fused else None,
                       "plan": {"dtype": str(plan.dtype).removeprefix("torch."),
                                "quantization": plan.quantization.value,
                                "quantized_rows": plan.quantized_rows,
                                "head_quantized_rows": plan.head_quantized_rows}}, f, indent=1)
    return 0


BENCHMARK = Benchmark("kernels", "this machine's measured kernel table and the plan derived from it",
                      add_arguments, run)
