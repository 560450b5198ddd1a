"""Which batch sizes run a GGUF file's block kernels, chosen by measurement on this machine.

The block kernels (csrc/gguf_ops.cpp) stream each weight byte once for all of a call's rows,
which wins while a step is bound by memory (decode); past some batch size the dense GEMM wins, over
the layer dequantized for that call or, where `--weights-memory dense` allows, over a dense copy.
Where the two cross depends on the CPU, the formats and the model's shapes, so it is timed on the
model's own blocks (a few layers, cycled so that they stream from memory as in a step) and cached
like the other kernel tables (segue/model/table_cache.py). Where an op's Q4_0, Q4_1, Q8_0 or Q4_K
matrices can be repacked as rows16 (gguf_blocks.BlockLayout), the block kernels are timed in both
layouts and the layout faster at one row (a single agent's decode) is the op's.
"""
from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch

from segue.model import table_cache, timing
from segue.model.config import ModelConfig
from segue.model.gguf_blocks import BlockLayout, BlockLinear, GGMLBlocks, WeightsMemory, concat_rows, rows16_applies
from segue.model.table_cache import MeasuredTable

logger = logging.getLogger(__name__)

ROWS: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256)
TABLE_METHOD = "gguf-blocks-2"
# Batches up to this many rows are decode-sized: the default where the timing cannot tell.
DECODE_ROWS = 8
# Layers cycled through per timed call: more bytes than any CPU's last-level cache.
STREAMED_BYTES = 256 << 20


@dataclass
class BlockTable(MeasuredTable):
    # op ("layers", "lm_head") -> candidate ("blocks", "rows16", "dequant", "dense") -> {rows: ms}
    timings_ms: dict[str, dict[str, dict[int, float]]]

    @staticmethod
    def timings_from_json(timings: Any) -> dict[str, dict[str, dict[int, float]]]:
        return {op: {c: {int(r): float(ms) for r, ms in rows.items()} for c, rows in cands.items()}
                for op, cands in timings.items()}

    def layout(self, op: str) -> BlockLayout:
        """The op's block layout: rows16 where it was timed and is faster at one row (where the
        noise hid the difference, the file's)."""
        times = self.timings_ms[op]
        if BlockLayout.ROWS16.value not in times:
            return BlockLayout.FILE
        ms = {c: times[c][1] for c in ("blocks", BlockLayout.ROWS16.value)}
        picked = timing.pick(ms, "blocks", self.ratios_at(op, 1))
        return BlockLayout.ROWS16 if picked == BlockLayout.ROWS16.value else BlockLayout.FILE

    def block_rows(self, op: str, other: str) -> int:
        """The largest timed row count up to which the block kernel (in the op's layout) runs at
        every timed size: where the timing decided, the faster one; where the noise hid the
        difference, the blocks for decode batches (up to DECODE_ROWS: the kernels were made for
        them) and `other` above."""
        times = self.timings_ms[op]
        blocks = "blocks" if self.layout(op) is BlockLayout.FILE else BlockLayout.ROWS16.value
        limit = 0
        for rows in sorted(times[blocks]):
            ms = {c: times[c][rows] for c in (blocks, other)}
            default = blocks if rows <= DECODE_ROWS else other
            if timing.pick(ms, default, self.ratios_at(op, rows)) != blocks:
                break
            limit = rows
        return limit

    def format(self) -> str:
        lines = []
        for op, cands in self.timings_ms.items():
            lines.append(f"{op} (ms per call)")
            lines.append("  rows      " + "".join(f"{c:>11}" for c in cands))
            for r in sorted({r for rows in cands.values() for r in rows}):
                lines.append(f"  {r:<8}" + "".join(f"{cands[c].get(r, float('nan')):11.3f}" for c in cands))
        return "\n".join(lines)


def layer_segments(weights: Mapping[str, Any], i: int) -> list[list[GGMLBlocks]] | None:
    """Layer i's four projections as block segments, or None where any is not blocks."""
    p = f"model.layers.{i}."
    groups = [[f"self_attn.{n}_proj" for n in "qkv"], ["self_attn.o_proj"], ["mlp.gate_proj", "mlp.up_proj"],
              ["mlp.down_proj"]]
    out = []
    for names in groups:
        parts = [weights[p + n + ".weight"] for n in names]
        if not all(isinstance(w, GGMLBlocks) for w in parts):
            return None
        out.append(concat_rows(parts))
    return out


def table_key(config: ModelConfig, weights: Mapping[str, Any], dtype: torch.dtype, kernels: ModuleType,
              memory: WeightsMemory) -> dict[str, str]:
    from segue.model.kernel_table import cpu_identity

    types = sorted({f"{n.split('.')[-2]}:{w.type_name}" for n, w in weights.items() if isinstance(w, GGMLBlocks)})
    shapes = (config.hidden_size, config.intermediate_size, config.num_heads, config.num_kv_heads,
              config.head_dim, config.vocab_size)
    return {**cpu_identity(), "method": TABLE_METHOD, "threads": str(torch.get_num_threads()),
            "torch": torch.__version__, "kernels": getattr(kernels, "__name__", "none"),
            "shapes": ",".join(map(str, shapes)), "types": ",".join(types), "dtype": str(dtype),
            "memory": memory.value}


def _call_each(fs: Sequence[Callable[[torch.Tensor], torch.Tensor]], xs: Sequence[torch.Tensor]) -> None:
    for f, x in zip(fs, xs, strict=True):
        f(x)


def measure(config: ModelConfig, weights: Mapping[str, Any], dtype: torch.dtype, kernels: ModuleType,
            memory: WeightsMemory, key: dict[str, str]) -> BlockTable:
    layers = [s for i in range(config.num_layers) if (s := layer_segments(weights, i)) is not None]
    head_name = "model.embed_tokens.weight" if config.tie_word_embeddings else "lm_head.weight"
    head = weights.get(head_name)
    gen = torch.Generator().manual_seed(0)
    ops: dict[str, list[list[list[GGMLBlocks]]]] = {}
    if layers:
        per_layer = sum(b.nbytes for segs in layers[0] for b in segs)
        ops["layers"] = layers[:max(1, min(len(layers), -(-STREAMED_BYTES // per_layer)))]
    if isinstance(head, GGMLBlocks):
        ops["lm_head"] = [[[head]]]
    timings: dict[str, dict[str, dict[int, float]]] = {}
    ratios: dict[str, dict[str, dict[str, tuple[float, float, float]]]] = {}
    busy = timing.machine_busy()
    unstable: list[str] = []
    t0 = time.perf_counter()
    for op, sets in ops.items():
        built: dict[str, list[list[Callable[[torch.Tensor], torch.Tensor]]]] = {
            "blocks": [[BlockLinear(s, None, dtype, kernels, block_rows=1 << 30) for s in segs] for segs in sets],
            "dequant": [[BlockLinear(s, None, dtype, kernels, block_rows=0) for s in segs] for segs in sets]}
        if any(rows16_applies(b, dtype, kernels) for segs in sets for s in segs for b in s):
            built[BlockLayout.ROWS16.value] = [[BlockLinear(s, None, dtype, kernels, block_rows=1 << 30,
                                                            layout=BlockLayout.ROWS16) for s in segs] for segs in sets]
        if memory is WeightsMemory.DENSE:
            built["dense"] = [[functools.partial(torch.nn.functional.linear, weight=BlockLinear(
                s, None, dtype, kernels, 0).dequantize()) for s in segs] for segs in sets]
        timings[op] = {name: {} for name in built}
        ratios[op] = {}
        for rows in ROWS:
            xs = [torch.randn(rows, segs[0].shape[1], generator=gen).to(dtype) for segs in sets[0]]
            calls = {name: [functools.partial(_call_each, fs, xs) for fs in layer_fs]
                     for name, layer_fs in built.items()}
            result = timing.time_candidates(calls, reps=2)
            busy = busy or result.busy
            if not result.stable:
                unstable.append(f"{op} {rows} rows")
            for name, ms in result.ms.items():
                timings[op][name][rows] = ms
            ratios[op][str(rows)] = result.ratios
    noisy = timing.report("GGUF block table", busy, unstable, time.perf_counter() - t0)
    return BlockTable(key, timings, noisy, ratios)


def block_table(config: ModelConfig, weights: Mapping[str, Any], dtype: torch.dtype, kernels: ModuleType,
                memory: WeightsMemory) -> BlockTable:
    key = table_key(config, weights, dtype, kernels, memory)
    return table_cache.cached_table("gguf", key, BlockTable,
                                    lambda stale: measure(config, weights, dtype, kernels, memory, key))
