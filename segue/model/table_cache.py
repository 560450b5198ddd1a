"""Where the measured kernel tables live: on disk under their key, and in this process.

Three tables are measured on the machine that runs them (GEMMs: kernel_table.py; attention:
attention_table.py; elementwise ops: fused_table.py). Each is cached on disk under a key of
everything its timings depend on, and kept for the process once measured or loaded, noisy ones
included, so an engine started again in the same process (a benchmark's configurations, tests)
does not measure again. A table timed on a busy machine is reused only while the machine stays
busy (timing.reuse_cached).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from segue.model import timing

logger = logging.getLogger(__name__)


@dataclass
class MeasuredTable:
    key: dict[str, str]
    # What was timed -> candidate -> ladder point -> ms per call
    timings_ms: dict[str, Any]
    # Timed while the machine was busy or its rounds never agreed: measured again once it is quiet.
    noisy: bool = False

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=1)

    @classmethod
    def from_json(cls: type[T], text: str) -> T:
        raw = json.loads(text)
        return cls(raw["key"], cls.timings_from_json(raw["timings_ms"]), bool(raw.get("noisy", False)))

    @staticmethod
    def timings_from_json(timings: Any) -> Any:
        return timings


T = TypeVar("T", bound=MeasuredTable)


def cache_dir() -> Path:
    root = os.environ.get("SEGUE_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "segue")
    return Path(root) / "kernel_tables"


def cached_path(kind: str, key: dict[str, str]) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
    return cache_dir() / (digest + ".json" if kind == "gemm" else f"{kind}-{digest}.json")


def save(kind: str, table: MeasuredTable) -> None:
    """Into the cache where cached_table() looks for this machine's table."""
    path = cached_path(kind, table.key)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(table.to_json())
        tmp.replace(path)  # atomic: a concurrent start reads a whole table or none
    except OSError as e:  # a read-only home: measure again next time
        logger.warning("could not save the kernel table to %s (%s)", path, e)


def _load(kind: str, key: dict[str, str], table_type: type[T]) -> T | None:
    """The cached table of `key`, or None: none yet, unreadable, another key's, or timed on a busy
    machine while this one is quiet."""
    path = cached_path(kind, key)
    try:
        table = table_type.from_json(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError) as e:
        logger.warning("ignoring an unreadable kernel table %s (%s)", path, e)
        return None
    if table.key != key:
        return None
    if not timing.reuse_cached(table.noisy):
        logger.info("the cached %s table was measured on a noisy machine: measuring again", kind)
        return None
    return table


_memo: dict[tuple[str, str], MeasuredTable] = {}


def clear_memo() -> None:
    _memo.clear()


def cached_table(kind: str, key: dict[str, str], table_type: type[T], measure: Callable[[T | None], T],
                 usable: Callable[[T], bool] = lambda table: True, remeasure: bool = False) -> T:
    """This process's table of `key`, else the cached one, else `measure(stale)` (saved): `stale`
    is a cached table of this key that was not `usable` (one that lacks candidates asked for now),
    or None."""
    memo_key = (kind, json.dumps(key, sort_keys=True))
    held = _memo.get(memo_key)
    if not remeasure and isinstance(held, table_type) and usable(held):
        return held
    loaded = None if remeasure else _load(kind, key, table_type)
    if loaded is not None and usable(loaded):
        table = loaded
    else:
        table = measure(loaded)
        save(kind, table)
    _memo[memo_key] = table
    return table
