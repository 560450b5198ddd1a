"""The Mooncake (FAST'25) request traces, shipped gzip-compressed in segue/sim/data/mooncake
(Apache-2.0; origin and format in its NOTICE). SEGUE_WORKLOADS=DIR reads DIR/mooncake/<name>
(plain or .gz) instead, and --trace takes any file of the same format.

A request is an arrival time, prompt and output lengths, and the hashes of its prompt's 512-token
blocks (a prefix chain). The traces carry no text, so prompts are made up from the hashes: every
token of a block is a function of the block's hash, so equal hash chains give equal token chains
and Segue's own prefix hashing finds exactly the reuse the trace records."""
from __future__ import annotations

import gzip
import json
import os
import random
from dataclasses import dataclass
from pathlib import Path

from segue.sim.trace import TraceSegment
from segue.sim.workloads.trace_request import TraceRequest

PACKAGED_DIR = Path(__file__).resolve().parents[1] / "data" / "mooncake"
TRACES = ("conversation", "synthetic")
# The traces' block: hash_ids[i] names prompt tokens [512 i, 512 (i + 1)).
TRACE_BLOCK_TOKENS = 512


@dataclass(frozen=True)
class MooncakeRequest:
    timestamp_s: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]

    def block_tokens(self, units_per_block: int) -> list[int]:
        """The prompt in units of TRACE_BLOCK_TOKENS / units_per_block real tokens: block i is
        units_per_block ids derived from hash_ids[i] (the last block cut to the prompt's length).
        Ids are distinct per (hash, position), so different blocks never collide."""
        unit = TRACE_BLOCK_TOKENS // units_per_block
        n = -(-self.input_length // unit)
        out: list[int] = []
        for h in self.hash_ids:
            out.extend(range(h * units_per_block, (h + 1) * units_per_block))
        return out[:n]


def trace_path(name: str = "conversation") -> Path:
    """`name` is a packaged trace (conversation, synthetic) or a file path. The packaged copy is
    replaced by $SEGUE_WORKLOADS/mooncake/<name>_trace.jsonl[.gz] when that variable is set."""
    if name not in TRACES:
        path = Path(name)
        if not path.exists():
            raise FileNotFoundError(f"Mooncake trace {name!r}: neither {', '.join(TRACES)} nor an existing file")
        return path
    override = os.environ.get("SEGUE_WORKLOADS")
    base = Path(override) / "mooncake" if override else PACKAGED_DIR
    for candidate in (base / f"{name}_trace.jsonl", base / f"{name}_trace.jsonl.gz"):
        if candidate.exists():
            return candidate
    where = f"SEGUE_WORKLOADS={override}" if override else f"the package ({PACKAGED_DIR})"
    raise FileNotFoundError(f"Mooncake trace {name} not found in {where}")


def load_mooncake(name: str = "conversation", limit: int | None = None) -> list[MooncakeRequest]:
    """The trace's requests in arrival order; `limit`: only the first that many."""
    path = trace_path(name)
    opener = gzip.open if path.suffix == ".gz" else open
    out: list[MooncakeRequest] = []
    with opener(path, "rt", encoding="utf-8") as f:
        for line in f:
            if limit is not None and len(out) >= limit:
                break
            if not line.strip():
                continue
            row = json.loads(line)
            out.append(MooncakeRequest(row["timestamp"] / 1000.0, int(row["input_length"]),
                                       int(row["output_length"]), tuple(row["hash_ids"])))
    out.sort(key=lambda r: r.timestamp_s)
    return out


@dataclass
class MooncakeTraceRequest(TraceRequest):
    """A trace request for the simulated engine at full token scale: its prompt is built from
    the hash chain (not random), so prefix reuse in the engine is the trace's."""
    hash_ids: tuple[int, ...] = ()

    def materialize(self, rng: random.Random, vocab: tuple[int, int]) -> tuple[list[int], list[TraceSegment]]:
        lo, hi = vocab
        span = hi - lo
        prompt: list[int] = []
        for h in self.hash_ids:
            base = h * TRACE_BLOCK_TOKENS
            prompt.extend(lo + (base + k) * 2654435761 % span for k in range(TRACE_BLOCK_TOKENS))
        del prompt[self.prompt_tokens:]
        gen = self.segments[0][0]
        return prompt, [TraceSegment(max(1, gen), None, [], kind=self.kind)]


def as_trace_requests(requests: list[MooncakeRequest]) -> list[MooncakeTraceRequest]:
    return [MooncakeTraceRequest(f"mc{i}", "mooncake", r.input_length, [(r.output_length, None, 0)],
                                 hash_ids=r.hash_ids) for i, r in enumerate(requests)]
