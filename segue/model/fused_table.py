"""The elementwise ops' forms (segue/model/fused_ops.py) chosen by measurement, per row count.

Timed at the model's widths and dtype on the machine that runs them, cached beside the other
kernel tables (segue/model/kernel_table.py) and reused until its key changes, as the attention
table is (segue/model/attention_table.py): a form replaces the native one only where it was faster
beyond the noise of the timing (timing.py).
"""
from __future__ import annotations

import functools
import logging
import time
from dataclasses import dataclass
from types import ModuleType

import torch

from segue.model import fused_ops, table_cache, timing
from segue.model.config import ModelConfig
from segue.model.kernel_table import cpu_identity
from segue.model.table_cache import MeasuredTable

logger = logging.getLogger(__name__)

TABLE_METHOD = "fused-v2-paired"
ROWS = (1, 8, 64, 512, 2048)
BLOCK = 16


@dataclass
class FusedTable(MeasuredTable):
    timings_ms: dict[str, dict[str, dict[str, float]]]   # op -> form -> rows -> ms

    def chosen(self) -> dict[str, dict[int, str]]:
        """The form per op and timed row count; native on a tie (one call, no temporaries)."""
        return {op: {int(r): timing.pick({f: ms[r] for f, ms in forms.items()}, "native", self.ratios_at(op, r))
                     for r in forms["native"]}
                for op, forms in self.timings_ms.items()}

    def format(self) -> str:
        lines = ["elementwise ops (ms per layer call): native / torch, chosen"]
        for op, choice in self.chosen().items():
            forms = self.timings_ms[op]
            cells = ", ".join(f"{r}: {forms['native'][str(r)]:.3f} / {forms['torch'][str(r)]:.3f} {c}"
                              for r, c in choice.items())
            lines.append(f"  {op:<15}{cells}")
        return "\n".join(lines)


def table_key(config: ModelConfig, dtype: torch.dtype, kv_dtype: torch.dtype, kernels: ModuleType) -> dict[str, str]:
    return {**cpu_identity(), "method": TABLE_METHOD, "threads": str(torch.get_num_threads()),
            "torch": torch.__version__, "kernels": kernels.__name__,
            "widths": f"{config.hidden_size},{config.intermediate_size},{config.num_heads}/{config.num_kv_heads}x"
                      f"{config.head_dim}",
            "dtype": str(dtype).removeprefix("torch."), "kv_dtype": str(kv_dtype).removeprefix("torch.")}


def fused_table(config: ModelConfig, dtype: torch.dtype, kv_dtype: torch.dtype, kernels: ModuleType,
                remeasure: bool = False) -> FusedTable:
    """This machine's table for the model's widths: this process's, else the cached one, else measured."""
    key = table_key(config, dtype, kv_dtype, kernels)
    return table_cache.cached_table("fused", key, FusedTable,
                                    lambda stale: measure(config, dtype, kv_dtype, kernels, key), remeasure=remeasure)


def measure(config: ModelConfig, dtype: torch.dtype, kv_dtype: torch.dtype, kernels: ModuleType,
            key: dict[str, str]) -> FusedTable:
    busy: list[str | None] = [timing.machine_busy()]
    gen = torch.Generator().manual_seed(0)
    h, inter, nh, kvh, hd = (config.hidden_size, config.intermediate_size, config.num_heads, config.num_kv_heads,
                             config.head_dim)
    weight = (1 + 0.1 * torch.randn(h, generator=gen)).to(dtype)
    inv_freq = torch.rand(hd // 2, generator=gen, dtype=torch.float64)
    freqs = torch.outer(torch.arange(4096, dtype=torch.float64), inv_freq)
    cos, sin = freqs.cos().float().contiguous(), freqs.sin().float().contiguous()
    blocks = -(-max(ROWS) // BLOCK)
    kc = torch.zeros(kvh, blocks, BLOCK, hd, dtype=kv_dtype)
    vc = torch.zeros_like(kc)
    timings: dict[str, dict[str, dict[str, float]]] = {op: {"native": {}, "torch": {}} for op in fused_ops.OPS}
    ratios: dict[str, dict[str, timing.Ratios]] = {op: {} for op in fused_ops.OPS}
    unstable = []
    t0 = time.perf_counter()
    for rows in ROWS:
        hs = torch.randn(rows, h, generator=gen).to(dtype)
        delta = torch.randn(rows, h, generator=gen).to(dtype) * 1e-3
        qkv = torch.randn(rows, (nh + 2 * kvh) * hd, generator=gen).to(dtype)
        gate_up = torch.randn(rows, 2 * inter, generator=gen).to(dtype)
        positions = torch.randint(0, 4096, (rows,), generator=gen)
        slots = torch.randperm(blocks * BLOCK, generator=gen)[:rows]
        rope = fused_ops.Rope(cos, sin, nh, kvh)
        norm_args = (hs, delta, weight, config.rms_norm_eps)
        cases = {
            "add_rms_norm": {"native": functools.partial(kernels.add_rms_norm, *norm_args),
                             "torch": functools.partial(fused_ops.add_rms_norm, *norm_args)},
            "rope_and_cache": {"native": functools.partial(kernels.rope_and_cache, qkv, positions, cos, sin, kc, vc,
                                                           slots, nh, kvh),
                               "torch": functools.partial(fused_ops.rope_and_cache, qkv, positions, rope, kc, vc,
                                                          slots)},
            "silu_mul": {"native": functools.partial(kernels.silu_mul, gate_up),
                         "torch": functools.partial(fused_ops.silu_mul, gate_up)},
        }
        for op, forms in cases.items():
            result = timing.time_candidates({f: [call] for f, call in forms.items()}, reps=5,
                                            pairs=[("torch", "native")])
            if not result.stable:
                unstable.append(f"{op} {rows}")
            busy.append(result.busy)
            ratios[op][str(rows)] = result.ratios
            for form, ms in result.ms.items():
                timings[op][form][str(rows)] = ms
    noisy = timing.report("elementwise-op table", timing.first(busy), unstable, time.perf_counter() - t0)
    return FusedTable(key, timings, noisy, ratios)
