"""Kernels chosen by measurement on the machine that runs them.

Which matmul is fastest for a batch of M rows depends on the CPU: on an AVX2 EPYC the int8
kernel beat the fp32 GEMM up to 96 rows of the LM head, while on a CPU with AVX512-BF16 oneDNN's
bf16 GEMM beats it well below that, and bf16 there is faster than fp32 by ~3x (emulated, it is
~4x slower on AVX2). No fixed threshold is right everywhere, so at the first start on a machine
every candidate is timed on the model's own shapes at a ladder of batch sizes, and the fastest
is used per (op, row range). The table is cached (segue/model/table_cache.py) under a key of the
CPU's model and what -march=native targets, the thread count, torch's version, the native
kernels' build and the model's shapes: a table from another machine is never used.

Every decision the plan takes from the table compares two candidates timed side by side in the
same cycles (timing.py): a quantized kernel against a GEMM at the same rows, and a GEMM against
itself padded to the next timed row count (timed as a candidate of its own at the smaller count,
so padding is never judged by two row counts measured seconds apart under different load).
"""
from __future__ import annotations

import functools
import hashlib
import itertools
import logging
import math
import os
import platform
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from segue.model import table_cache, timing
from segue.model.config import ModelConfig
from segue.model.table_cache import MeasuredTable

logger = logging.getLogger(__name__)

# Row counts timed: decode batches up to the large-batch regime, then prefill chunks. Agents'
# decode batches are mostly 1-4 sequences (tools hold the rest), and a quantized kernel's lead
# shrinks with every row, so 2 and 4 are timed too: with 1 and 8 alone, int4 layers won at 1 row
# and tied the bf16 GEMM at 8 on an AMD EPYC (avx512_bf16: 0.46 against 0.457 ms), so whether
# batches of 2-8 ran int4 was a coin flip, and bf16 takes 0.361 ms a layer at 2 rows where int4
# takes 0.175.
ROWS: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 512, 2048)
# The LM head only runs the rows that sample (one per sequence), never a whole prefill chunk.
HEAD_ROWS: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256)
# The quantized kernels stream weights for a few activation rows; beyond this they are
# compute-bound and slower than any GEMM (they lose from well below it everywhere measured),
# so timing them at 2048 rows would only cost start-up time.
QUANT_MAX_ROWS = 512
DTYPES = ("float32", "bfloat16")
# Changes whenever the way of measuring does: tables measured another way are measured again.
TABLE_METHOD = "paired-ratio-interval-padded-v1"
# Batches up to this many rows are timed over weight sets totalling at least STREAMED_BYTES (in
# fp32), more than any CPU's last-level cache, as the model's layers are.
STREAMED_MAX_ROWS = 128
STREAMED_BYTES = 512 << 20


def _compiler_target() -> str | None:
    """A digest of what `-march=native` compiles for here (the compiler's predefined macros): the
    instruction sets the native kernels use, on every architecture, where /proc/cpuinfo's flags
    line exists only on x86 (on aarch64 every CPU would share one key, and a build for one could
    die of SIGILL on another). None without a compiler (then no native kernels are built either)."""
    import shutil
    import subprocess

    compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    if compiler is None:
        return None
    try:
        macros = subprocess.run([compiler, "-march=native", "-dM", "-E", "-x", "c++", os.devnull],
                                capture_output=True, text=True, timeout=60, check=True).stdout
    except (OSError, subprocess.SubprocessError) as e:
        logger.info("could not ask %s what -march=native targets (%s); keying by /proc/cpuinfo", compiler, e)
        return None
    return hashlib.sha256("\n".join(sorted(macros.splitlines())).encode()).hexdigest()[:16]


@functools.lru_cache(maxsize=1)
def cpu_identity() -> dict[str, str]:
    """The CPU's model name and a digest of what the native kernels are compiled for on it."""
    model, flags = "", ""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                name, _, value = line.partition(":")
                name = name.strip()
                # x86 names its model; aarch64 gives an implementer and part number per core.
                if name in ("model name", "Hardware", "CPU implementer", "CPU part") and value.strip() not in model:
                    model = f"{model} {value.strip()}".strip() if name != "model name" else value.strip()
                elif name in ("flags", "Features") and not flags:
                    flags = value.strip()
    except OSError:  # no /proc (macOS, Windows): torch's dispatch level stands in for the flags
        import torch

        flags = f"torch-capability {torch.backends.cpu.get_cpu_capability()}"
    target = _compiler_target()
    digest = target or hashlib.sha256(" ".join(sorted(flags.split())).encode()).hexdigest()[:16]
    return {"cpu": model or platform.processor() or platform.machine(), "machine": platform.machine(),
            "flags": digest}


@dataclass
class KernelTable(MeasuredTable):
    # op ("layers": one decoder layer's four projections; "lm_head") -> candidate -> {rows: ms}
    timings_ms: dict[str, dict[str, dict[int, float]]]

    def best(self, op: str, rows: int, candidates: tuple[str, ...]) -> str:
        """The fastest candidate at the smallest timed row count >= rows (the largest if none)."""
        times = self.timings_ms[op]
        # Every candidate's counts: past the quantized range only the leading dtype is timed.
        ladder = sorted({r for rows_ms in times.values() for r in rows_ms})
        bucket = timing.bucket(ladder, rows)
        timed = [c for c in candidates if bucket in times.get(c, {})]
        return min(timed, key=lambda c: times[c][bucket])

    def padded_rows(self, op: str, dtype: str) -> dict[int, int]:
        """Every timed row count with the count its `dtype` GEMM should run at: a larger timed
        count where padding is faster by the margin, else itself. On a 2-core Xeon with AMX, bf16
        took 0.73 ms a layer at 8 rows and 1.06 ms at 4 (its kernels tile rows in blocks). A
        measured table pads a count to the next one only where the two, timed side by side, say
        so with confidence, and follows that one's padding on (each step is faster)."""
        times = self.timings_ms[op][dtype]
        ladder = sorted(times)
        if op not in self.ratios:  # a table written by hand: its medians
            out = {}
            for i, rows in enumerate(ladder):
                target = min(ladder[i:], key=lambda r: times[r])
                out[rows] = target if times[target] < times[rows] * (1 - timing.MARGIN) else rows
            return out
        padded: dict[int, int] = {}
        for rows, above in reversed(list(zip(ladder, ladder[1:] + [0], strict=True))):
            ratios = self.ratios_at(op, rows)
            faster = above and ratios is not None and timing.clearly_faster(ratios, padded_name(dtype, above), dtype)
            padded[rows] = padded[above] if faster else rows
        return dict(sorted(padded.items()))

    def dense_dtype(self) -> str:
        """The dtype whose GEMMs are fastest, each timed row count weighing alike (the sum of
        log time ratios to the fastest dtype there): one disturbed measurement cannot outvote
        the rest, and tiny decode batches do not outweigh prefill chunks. Counts timed while the
        process waited for its CPUs count only when no other count was timed undisturbed."""
        layers = self.timings_ms["layers"]
        quiet = {r for r, pairs in self.ratios.get("layers", {}).items() if pairs}
        kept = {d: {r: ms for r, ms in rows.items() if str(r) in quiet} for d, rows in layers.items()}
        return _leading_dtype(kept if all(kept.get(d) for d in DTYPES) and _shared(kept) else layers)

    def quantized_up_to(self, op: str, quant: str, dtype: str) -> int:
        """The largest row count up to which the quantized kernel beats the `dtype` GEMM by the
        margin at every timed size (0: never). Rows in between follow the size above."""
        times = self.timings_ms[op]
        limit = 0
        for rows in sorted(times[dtype]):
            if rows not in times.get(quant, {}):
                break
            # Only a clear win: at a tie, which kernel runs would follow the noise of one table.
            ratios = self.ratios_at(op, rows)
            if ratios is not None:
                wins = timing.clearly_faster(ratios, quant, dtype)
            else:
                wins = times[quant][rows] < times[dtype][rows] * (1 - timing.MARGIN)
            if not wins:
                break
            limit = rows
        return limit

    @staticmethod
    def timings_from_json(timings: Any) -> dict[str, dict[str, dict[int, float]]]:
        return {op: {c: {int(r): float(ms) for r, ms in rows.items()} for c, rows in cands.items()}
                for op, cands in timings.items()}

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


def padded_name(dtype: str, rows: int) -> str:
    """The candidate that runs `dtype`'s GEMM at `rows` rows, timed beside a smaller count."""
    return f"{dtype}@{rows}"


def _shared(times: dict[str, dict[int, float]]) -> set[int]:
    return set.intersection(*(set(times[d]) for d in DTYPES))


def _leading_dtype(times: dict[str, dict[int, float]]) -> str:
    """Over the row counts every dtype was timed at."""
    shared = _shared(times)

    def cost(dtype: str) -> float:
        return sum(math.log(times[dtype][rows] / min(times[d][rows] for d in DTYPES)) for rows in shared)
    return min(DTYPES, key=cost)


def _call_each(fs: Sequence[Callable[[Any], object]], xs: Sequence[Any]) -> list[object]:
    return [f(x) for f, x in zip(fs, xs, strict=True)]


ALL_QUANTS = ("int8", "int4")


def measure(config: ModelConfig, kernels: ModuleType | None, key: dict[str, str],
            quants_wanted: tuple[str, ...] = ALL_QUANTS) -> KernelTable:
    """Time each candidate on random weights of the model's shapes (the values do not matter to
    the speed; the model's own weights need not be loaded yet)."""
    import torch
    import torch.nn.functional as F

    from segue.model.quant import LinearWeights, Quantization, group_supported

    h, kvh, hd = config.hidden_size, config.num_kv_heads, config.head_dim
    shapes = [((config.num_heads + 2 * kvh) * hd, h), (h, config.num_heads * hd),
              (2 * config.intermediate_size, h), (h, config.intermediate_size)]
    gen = torch.Generator().manual_seed(0)
    # Only the formats the plan may run: quantizing and timing them is most of a table's time.
    quants = [q for q in (Quantization.INT8, Quantization.INT4) if q.value in quants_wanted
              if kernels is not None and all(group_supported(k) for _, k in shapes)]

    def layer_candidates(op_shapes: list[tuple[int, int]], ladder: tuple[int, ...],
                         copies: int) -> tuple[dict[str, dict[int, float]], dict[str, timing.Ratios]]:
        """ms per call of the ops in `op_shapes` at each row count. Small batches stream their
        weights from memory in the real model (every layer's are different), so they cycle
        through `copies` weight sets, as many as it takes to outgrow the CPU's caches: timing one
        cached set made the kernels that read more bytes look as fast as those that read fewer."""
        sets = [[torch.randn(n, k, generator=gen) * 0.02 for n, k in op_shapes] for _ in range(copies)]

        def dense(ws: list[torch.Tensor], dt: torch.dtype) -> list[Callable[[torch.Tensor], torch.Tensor]]:
            # Each weight converted once, here: a timed call is the GEMM alone.
            return [functools.partial(F.linear, weight=w.to(dt)) for w in ws]

        def quantized(ws: list[torch.Tensor], quant: Quantization) -> list[Callable[[torch.Tensor], torch.Tensor]]:
            return [LinearWeights(w, None, quant, torch.float32, kernels, dense_above=1 << 30) for w in ws]

        makers: dict[str, Callable[[list[torch.Tensor]], list[Callable[[torch.Tensor], torch.Tensor]]]] = {}
        for dtype in DTYPES:
            makers[dtype] = functools.partial(dense, dt=getattr(torch, dtype))
        for quant in quants:
            makers[quant.value] = functools.partial(quantized, quant=quant)
        built = {name: [make(ws) for ws in sets] for name, make in makers.items()}
        out: dict[str, dict[int, float]] = {name: {} for name in makers}
        ratios: dict[str, timing.Ratios] = {}

        def activations(count: int) -> dict[str, list[torch.Tensor]]:
            x32 = [torch.randn(count, k, generator=gen) for _, k in op_shapes]
            # In the GEMM's dtype; the quantized kernels take fp32 (they widen any other).
            return {name: [x.to(getattr(torch, name)) for x in x32] if name in DTYPES else x32 for name in built}

        for rows, above in zip(ladder, ladder[1:] + (0,), strict=True):
            n = copies if rows <= STREAMED_MAX_ROWS else 1  # large batches are compute-bound
            xs = activations(rows)
            # One call: a whole layer's projections (or the LM head), as the forward runs them.
            # Past the quantized kernels' range only the leading dtype is timed: the dtype is
            # decided by then, and a 2,048-row fp32 GEMM is a table's longest call.
            dense_names = [d for d in DTYPES if rows <= QUANT_MAX_ROWS or d == _leading_dtype(out)]
            quant_names = [q.value for q in quants] if rows <= QUANT_MAX_ROWS else []
            calls: dict[str, list[Callable[[], object]]] = {
                name: [functools.partial(_call_each, fs, xs[name]) for fs in built[name][:n]]
                for name in dense_names + quant_names}
            pairs = [(q, d) for q in quant_names for d in dense_names] + list(itertools.combinations(dense_names, 2))
            if above and above <= STREAMED_MAX_ROWS:
                # The GEMM padded to the next count, beside it: both dtypes at first, then the
                # one leading so far (the other is rarely run, and unpadded is its safe default).
                xs_above = activations(above)
                for d in dense_names if not out[DTYPES[0]] else [_leading_dtype(out)]:
                    calls[padded_name(d, above)] = [functools.partial(_call_each, fs, xs_above[d])
                                                    for fs in built[d][:n]]
                    pairs.append((padded_name(d, above), d))
            result = timing.time_candidates(calls, reps=3 if n > 1 else 5, pairs=pairs)
            if not result.stable:
                unstable.append(f"{rows} rows")
            busy.append(result.busy)
            ratios[str(rows)] = result.ratios
            for name, ms in result.ms.items():
                if name in out:
                    out[name][rows] = ms
        return out, ratios

    busy: list[str | None] = [timing.machine_busy()]
    unstable: list[str] = []
    layer_bytes = 4 * sum(n * k for n, k in shapes)
    copies = max(1, min(config.num_layers, -(-STREAMED_BYTES // layer_bytes)))
    head_copies = max(1, min(4, -(-STREAMED_BYTES // (4 * config.vocab_size * h))))
    t0 = time.perf_counter()
    layers, layer_ratios = layer_candidates(shapes, ROWS, copies)
    head, head_ratios = layer_candidates([(config.vocab_size, h)], HEAD_ROWS, head_copies)
    noisy = timing.report("kernel table", timing.first(busy), unstable, time.perf_counter() - t0)
    return KernelTable(key, {"layers": layers, "lm_head": head}, noisy,
                       {"layers": layer_ratios, "lm_head": head_ratios})


def table_key(config: ModelConfig, kernels: ModuleType | None) -> dict[str, str]:
    import torch

    shapes = (config.hidden_size, config.intermediate_size, config.num_heads, config.num_kv_heads,
              config.head_dim, config.vocab_size)
    return {**cpu_identity(), "method": TABLE_METHOD, "threads": str(torch.get_num_threads()),
            "torch": torch.__version__, "kernels": getattr(kernels, "__name__", "none"),
            "shapes": ",".join(map(str, shapes))}


def _has(table: KernelTable, quants: tuple[str, ...], kernels: ModuleType | None) -> bool:
    """Whether the table timed every format in `quants` it could time here."""
    return kernels is None or all(q in table.timings_ms["layers"] for q in quants)


def kernel_table(config: ModelConfig, kernels: ModuleType | None, remeasure: bool = False,
                 quants: tuple[str, ...] = ALL_QUANTS) -> KernelTable:
    """This machine's table for the model's shapes, with the quantized formats in `quants` among
    its candidates: from the cache when its key matches exactly and it has those formats (however
    noisy the machine was when it was timed), else measured now (seconds) and saved."""
    key = table_key(config, kernels)

    def measure_now(stale: KernelTable | None) -> KernelTable:
        wanted = quants
        if stale is not None:  # another run's formats: time those too, not instead
            wanted = tuple(sorted(set(quants) | {q for q in ALL_QUANTS if q in stale.timings_ms["layers"]}))
        return measure(config, kernels, key, wanted)

    return table_cache.cached_table("gemm", key, KernelTable, measure_now,
                                    usable=lambda table: _has(table, quants, kernels), remeasure=remeasure)
