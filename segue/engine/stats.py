"""What an engine reports about itself: a load report for routing, a stats snapshot for /metrics.

Typed, so that a cluster combines its replicas' answers field by field as each field means (queue
lengths and block counts add up; a tool's duration summary cannot be added, so the replica with
the most observations speaks for it) instead of guessing from the values' shapes.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Callable, Sequence, TypeVar

from segue.predict.accuracy import AccuracySnapshot
from segue.tools.stats import DurationSummary

# The summaries' types travel with the stats: callers read them from here, not from the engine's parts.
__all__ = ["AccuracySnapshot", "DurationSummary", "EngineStats", "LoadReport", "PausedKV"]


@dataclass(frozen=True)
class LoadReport:
    """A replica's queues and KV pool as of one of its outputs (lock-free reads: a hint, not a census)."""
    running: int = 0
    waiting: int = 0
    paused: int = 0
    kv_used_blocks: int = 0
    kv_total_blocks: int = 0

    @property
    def queued(self) -> int:
        return self.running + self.waiting


@dataclass(frozen=True)
class PausedKV:
    """Paused requests under one KV disposition (preserve, swap, discard) and the blocks they hold."""
    requests: int = 0
    device_blocks: int = 0
    host_blocks: int = 0


@dataclass(frozen=True)
class EngineStats:
    """One consistent snapshot of an engine, taken between steps."""
    running: int = 0
    waiting: int = 0
    paused: int = 0
    swapped: int = 0
    device_blocks_used: int = 0
    device_blocks_total: int = 0
    host_blocks_used: int = 0
    host_blocks_total: int = 0
    # By disposition value ("preserve", "swap", "discard").
    paused_kv: dict[str, PausedKV] = field(default_factory=dict)
    # GB*s of device KV held without producing tokens, by cause (WasteTotals.as_dict()).
    waste: dict[str, float] = field(default_factory=dict)
    preemptions: int = 0
    prefix_hit_tokens: int = 0
    prefix_query_tokens: int = 0
    steps: int = 0
    # Seconds the executor took for those steps, and what the scheduler's cost model charges the
    # same batches (sched/step_charge.py, the simulator's charge). Their ratio is how much slower
    # this engine runs than its profile: a profile taken on another machine or an idle one (the
    # HTTP frontend shares a CPU's cores), which `segue sim --step-time-scale` can replay.
    step_seconds: float = 0.0
    modelled_step_seconds: float = 0.0
    tools: dict[str, DurationSummary] = field(default_factory=dict)
    predictors: dict[str, AccuracySnapshot] = field(default_factory=dict)

    @classmethod
    def merge(cls, stats: Sequence[EngineStats]) -> EngineStats:
        """Several replicas' snapshots as one engine's: counts add, summaries keep the best-informed."""
        if not stats:
            return cls()
        counts = {name: sum(getattr(s, name) for s in stats) for name in _COUNTS}
        return cls(**counts,
                   paused_kv=_merge_by_key([s.paused_kv for s in stats], _add_paused),
                   waste=_merge_by_key([s.waste for s in stats], lambda a, b: a + b),
                   tools=_merge_by_key([s.tools for s in stats], _most_observed),
                   predictors=_merge_by_key([s.predictors for s in stats], _most_observed))


# The fields that are counts (requests, blocks, tokens, steps): a pool's is the sum of its replicas'.
_COUNTS = tuple(f.name for f in fields(EngineStats)
                if f.name not in ("paused_kv", "waste", "tools", "predictors"))

V = TypeVar("V")
S = TypeVar("S", DurationSummary, AccuracySnapshot)


def _merge_by_key(dicts: Sequence[dict[str, V]], combine: Callable[[V, V], V]) -> dict[str, V]:
    merged: dict[str, V] = {}
    for d in dicts:
        for key, value in d.items():
            merged[key] = combine(merged[key], value) if key in merged else value
    return merged


def _add_paused(a: PausedKV, b: PausedKV) -> PausedKV:
    return PausedKV(a.requests + b.requests, a.device_blocks + b.device_blocks, a.host_blocks + b.host_blocks)


def _most_observed(a: S, b: S) -> S:
    # Quantiles and error rates of different windows do not add; the fuller window is the better guess.
    return b if b.count > a.count else a
