"""Kernels chosen by measurement on the machine that runs them.

Which matmul is fastest for a batch of M rows depends on the CPU: on an AVX2 EPYC the int8
kernel beat the fp32 GEMM up to 96 rows of the LM head, while on a CPU with AVX512-BF16 oneDNN's
bf16 GEMM beats it well below that, and bf16 there is faster than fp32 by ~3x (emulated, it is
~4x slower on AVX2). No fixed threshold is right everywhere, so at the first start on a machine
every candidate is timed on the model's own shapes at a ladder of batch sizes, and the fastest
is used per (op, row range). The table is cached on disk under a key of the CPU's model and
flags, the thread count, torch's version, the native kernels' build and the model's shapes: a
table from another machine is never used.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import platform
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from segue.model.config import ModelConfig

logger = logging.getLogger(__name__)

# Row counts timed: decode batches up to the large-batch regime, then prefill chunks.
ROWS: tuple[int, ...] = (1, 8, 16, 32, 64, 128, 512, 2048)
# The LM head only runs the rows that sample (one per sequence), never a whole prefill chunk.
HEAD_ROWS: tuple[int, ...] = (1, 8, 16, 32, 64, 128, 256)
# The quantized kernels stream weights for a few activation rows; beyond this they are
# compute-bound and slower than any GEMM (they lose from well below it everywhere measured),
# so timing them at 2048 rows would only cost start-up time.
QUANT_MAX_ROWS = 512
DTYPES = ("float32", "bfloat16")
# Batches up to this many rows are timed over weight sets totalling at least STREAMED_BYTES (in
# fp32), more than any CPU's last-level cache, as the model's layers are.
STREAMED_MAX_ROWS = 128
STREAMED_BYTES = 512 << 20


def cpu_identity() -> dict[str, str]:
    """The CPU's model name and a digest of its feature flags (what -march=native compiles for)."""
    model, flags = platform.processor() or platform.machine(), ""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("model name") and model in ("", platform.machine(), platform.processor()):
                    model = line.split(":", 1)[1].strip()
                elif line.startswith("flags") and not flags:
                    flags = line.split(":", 1)[1].strip()
    except OSError:
        pass
    return {"cpu": model, "machine": platform.machine(),
            "flags": hashlib.sha256(" ".join(sorted(flags.split())).encode()).hexdigest()[:16]}


@dataclass
class KernelTable:
    key: dict[str, str]
    # op ("layers": one decoder layer's four projections; "lm_head") -> candidate -> {rows: ms}
    timings_ms: dict[str, dict[str, dict[int, float]]]

    def best(self, op: str, rows: int, candidates: tuple[str, ...]) -> str:
        """The fastest candidate at the smallest timed row count >= rows (the largest if none)."""
        times = self.timings_ms[op]
        ladder = sorted(next(iter(times.values())))
        bucket = next((r for r in ladder if r >= rows), ladder[-1])
        timed = [c for c in candidates if bucket in times.get(c, {})]
        return min(timed, key=lambda c: times[c][bucket])

    def dense_dtype(self) -> str:
        """The dtype whose GEMMs, after the quantized kernels take the rows they win, cost least
        per token summed over the ladder (decode batches and prefill chunks weigh alike)."""
        def cost(dtype: str) -> float:
            times = self.timings_ms["layers"]
            return sum(min(t, times.get("int8", {}).get(rows, float("inf"))) / rows
                       for rows, t in times[dtype].items())
        return min(DTYPES, key=cost)

    def quantized_up_to(self, op: str, quant: str, dtype: str) -> int:
        """The largest row count up to which the quantized kernel beats the `dtype` GEMM at every
        timed size (0: never). Rows in between follow the size above."""
        times = self.timings_ms[op]
        limit = 0
        for rows in sorted(times[dtype]):
            if rows not in times.get(quant, {}) or times[quant][rows] >= times[dtype][rows]:
                break
            limit = rows
        return limit

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=1)

    @classmethod
    def from_json(cls, text: str) -> KernelTable:
        raw = json.loads(text)
        timings = {op: {c: {int(r): float(ms) for r, ms in rows.items()} for c, rows in cands.items()}
                   for op, cands in raw["timings_ms"].items()}
        return cls(raw["key"], timings)

    def format(self) -> str:
        lines = []
        for op, cands in self.timings_ms.items():
            ladder = sorted({r for rows in cands.values() for r in rows})
            lines.append(f"{op} (ms per call)")
            lines.append("  rows      " + "".join(f"{c:>11}" for c in cands) + "   fastest")
            for r in ladder:
                cells = "".join(f"{cands[c][r]:11.3f}" if r in cands[c] else f"{'-':>11}" for c in cands)
                lines.append(f"  {r:<8}" + cells + "   " + self.best(op, r, tuple(cands)))
        return "\n".join(lines)


def _time_ms(calls: list[Callable[[], object]], reps: int = 3) -> float:
    """Median ms of one call over `reps` passes through `calls`. The median, not the mean or the
    minimum: on a small machine another process's time slice stalls an OpenMP region now and
    then (seen: 8 ms on a 0.2 ms call), and the minimum of a cycle through cached weights is too
    kind."""
    for call in calls:
        call()  # warm-up: first-touch of buffers, oneDNN's kernel selection
    times = []
    for _ in range(reps):
        for call in calls:
            t0 = time.perf_counter()
            call()
            times.append(time.perf_counter() - t0)
    times.sort()
    return times[len(times) // 2] * 1000


def measure(config: ModelConfig, kernels: object | None, key: dict[str, str]) -> KernelTable:
    """Time each candidate on random weights of the model's shapes (the values do not matter to
    the speed; the model's own weights need not be loaded yet)."""
    import torch
    import torch.nn.functional as F

    from segue.model.quant import LinearWeights, Quantization, group_supported

    h, kvh, hd = config.hidden_size, config.num_kv_heads, config.head_dim
    shapes = [((config.num_heads + 2 * kvh) * hd, h), (h, config.num_heads * hd),
              (2 * config.intermediate_size, h), (h, config.intermediate_size)]
    gen = torch.Generator().manual_seed(0)
    quants = [q for q in (Quantization.INT8, Quantization.INT4)
              if kernels is not None and all(group_supported(k) for _, k in shapes)]

    def layer_candidates(op_shapes: list[tuple[int, int]], ladder: tuple[int, ...],
                         copies: int) -> dict[str, dict[int, float]]:
        """ms per call of the ops in `op_shapes` at each row count. Small batches stream their
        weights from memory in the real model (every layer's are different), so they cycle
        through `copies` weight sets, as many as it takes to outgrow the CPU's caches: timing one
        cached set made the kernels that read more bytes look as fast as those that read fewer."""
        sets = [[torch.randn(n, k, generator=gen) * 0.02 for n, k in op_shapes] for _ in range(copies)]
        out: dict[str, dict[int, float]] = {}

        def timed(make_layers: Callable[[list[torch.Tensor]], list], dtype: torch.dtype, rows: int) -> float:
            n = copies if rows <= STREAMED_MAX_ROWS else 1  # large batches are compute-bound
            layers = [make_layers(ws) for ws in sets[:n]]
            xs = [torch.randn(rows, k, generator=gen).to(dtype) for _, k in op_shapes]
            # One call: a whole layer's projections (or the LM head), as the forward runs them.
            return _time_ms([lambda fs=fs: [f(x) for f, x in zip(fs, xs)] for fs in layers],
                            reps=3 if n > 1 else 5)

        for dtype in DTYPES:
            dt = getattr(torch, dtype)
            out[dtype] = {rows: timed(lambda ws: [(lambda x, w=w.to(dt): F.linear(x, w)) for w in ws], dt, rows)
                          for rows in ladder}
        for quant in quants:
            out[quant.value] = {
                rows: timed(lambda ws: [LinearWeights(w, None, quant, torch.float32, kernels, dense_above=1 << 30)
                                        for w in ws], torch.float32, rows)
                for rows in ladder if rows <= QUANT_MAX_ROWS}
        return out

    layer_bytes = 4 * sum(n * k for n, k in shapes)
    copies = max(1, min(config.num_layers, -(-STREAMED_BYTES // layer_bytes)))
    head_copies = max(1, min(4, -(-STREAMED_BYTES // (4 * config.vocab_size * h))))
    t0 = time.perf_counter()
    timings = {"layers": layer_candidates(shapes, ROWS, copies),
               "lm_head": layer_candidates([(config.vocab_size, h)], HEAD_ROWS, head_copies)}
    logger.info("kernel table measured in %.1f s", time.perf_counter() - t0)
    return KernelTable(key, timings)


def cache_dir() -> Path:
    root = os.environ.get("SEGUE_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "segue")
    return Path(root) / "kernel_tables"


def table_key(config: ModelConfig, kernels: object | None) -> dict[str, str]:
    import torch

    shapes = (config.hidden_size, config.intermediate_size, config.num_heads, config.num_kv_heads,
              config.head_dim, config.vocab_size)
    return {**cpu_identity(), "threads": str(torch.get_num_threads()), "torch": torch.__version__,
            "kernels": getattr(kernels, "__name__", "none"), "shapes": ",".join(map(str, shapes))}


def table_path(key: dict[str, str]) -> Path:
    return cache_dir() / (hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20] + ".json")


def kernel_table(config: ModelConfig, kernels: object | None) -> KernelTable:
    """This machine's table for the model's shapes: from the cache when its key matches exactly,
    else measured now (seconds) and saved."""
    key = table_key(config, kernels)
    path = table_path(key)
    try:
        table = KernelTable.from_json(path.read_text())
        if table.key == key:
            return table
    except (OSError, ValueError, KeyError) as e:
        if not isinstance(e, FileNotFoundError):
            logger.warning("ignoring an unreadable kernel table %s (%s)", path, e)
    table = measure(config, kernels, key)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(table.to_json())
        tmp.replace(path)  # atomic: a concurrent start reads a whole table or none
    except OSError as e:  # a read-only home: measure again next time
        logger.warning("could not save the kernel table to %s (%s)", path, e)
    return table
