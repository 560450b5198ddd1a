"""`segue bench kernels`: this machine's kernel table for a model (measured now if not cached)
and the plan the engine derives from it: the dtype, and up to how many rows each op runs the
quantized kernel. See segue/model/kernel_table.py."""
from __future__ import annotations

import argparse
import json

from segue.bench import Benchmark


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--remeasure", action="store_true", help="measure again even if a table is cached")
    p.add_argument("--output-json", default=None, help="write the table and the plan as JSON")


def run(args: argparse.Namespace) -> int:
    import torch

    from segue.engine_args import engine_config_from_args
    from segue.executor.kernel_plan import plan_kernels, resolve_device
    from segue.model import kernel_table as kt
    from segue.model.cpu_kernels import load_cpu_kernels
    from segue.model.loader import load_checkpoint

    config = engine_config_from_args(args)
    if config.num_threads:
        torch.set_num_threads(config.num_threads)
    device = resolve_device(config.model.device)
    if device.type != "cpu":
        raise SystemExit("the kernel table is a CPU's: on CUDA the plan is fixed (bf16, no quantization)")
    kernels = load_cpu_kernels()
    ckpt = load_checkpoint(config.model.model)
    model = ckpt.config
    if args.remeasure:
        table = kt.measure(model, kernels, kt.table_key(model, kernels))
        kt.save(table)  # where the engine looks, so the next start uses this measurement
    else:
        table = kt.kernel_table(model, kernels)
    plan = plan_kernels(config.model, model, device, kernels, ckpt.weights)
    print(f"CPU: {table.key['cpu']} (flags {table.key['flags']}), {table.key['threads']} threads, "
          f"torch {table.key['torch']}, kernels {table.key['kernels']}")
    print(table.format())
    print(f"plan for --dtype {config.model.dtype} --quantization {config.model.quantization}: "
          f"{str(plan.dtype).removeprefix('torch.')}; {plan.quantization.value} layers up to "
          f"{plan.quantized_rows} rows, {(plan.head_quantization or plan.quantization).value} LM head up to "
          f"{plan.head_quantized_rows} rows")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"table": json.loads(table.to_json()),
                       "plan": {"dtype": str(plan.dtype).removeprefix("torch."),
                                "quantization": plan.quantization.value,
                                "quantized_rows": plan.quantized_rows,
                                "head_quantized_rows": plan.head_quantized_rows}}, f, indent=1)
    return 0


BENCHMARK = Benchmark("kernels", "this machine's measured kernel table and the plan derived from it",
                      add_arguments, run)
