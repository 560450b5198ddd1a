"""Combining what `run_sync(fn)` returned on every replica into the one answer a caller expects.

Without a request id the pool runs fn everywhere. The server does that for two kinds of fn: lookups
by request id (only the replica holding the request answers; the others return None) and engine
snapshots for /metrics (counters and gauges, which add up across replicas). So: None is dropped, a
single answer is returned as is, and several are merged field by field: numbers add, tuples and
lists add element-wise, dicts merge by key, equal values stay. Per-replica summaries that cannot
be combined (tool duration quantiles) keep the replica with the most observations (`count`).
Anything else is a TypeError: a caller that needs one replica must name the request.
"""
from __future__ import annotations

from typing import Any, Sequence


def merge_results(results: Sequence[Any]) -> Any:
    present = [r for r in results if r is not None]
    if not present:
        return None
    if len(present) == 1:
        return present[0]
    return _merge(present)


def _merge(values: list[Any]) -> Any:
    first = values[0]
    if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
        return sum(values)
    if all(isinstance(v, dict) for v in values):
        keys = list(dict.fromkeys(k for v in values for k in v))
        return {k: merge_results([v.get(k) for v in values]) for k in keys}
    if all(type(v) is type(first) and isinstance(v, (tuple, list)) and len(v) == len(first) for v in values):
        return type(first)(merge_results(list(column)) for column in zip(*values, strict=True))
    if all(v == first for v in values):
        return first
    if all(isinstance(getattr(v, "count", None), int) for v in values):
        return max(values, key=lambda v: v.count)
    raise TypeError(f"cannot merge {type(first).__name__} results from several replicas; "
                    f"pass the request id to run on the replica that holds it")
