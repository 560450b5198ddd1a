"""Where the measured kernel tables live: on disk under their key, and in this process.

Three tables are measured on the machine that runs them (GEMMs: kernel_table.py; attention:
attention_table.py; elementwise ops: fused_table.py). Each is cached on disk under a key of
everything its timings depend on, and kept for the process once measured or loaded, noisy ones
included, so an engine started again in the same process (a benchmark's configurations, tests)
does not measure again. A table is reused at every later start until its key changes, noisy ones
included: each of its decisions was taken only where the difference stood outside the noise
(timing.py), so measuring again on the same machine would not make them safer, only make every
start wait and let the plan follow the noise of the day. Processes on one machine (`--engines N`
replicas, a server beside `segue bench`) measure a key once: the first takes a file lock and
measures, the others wait for it and load what it saved.

A table with points that decided nothing (timed while the process waited for its CPUs) is checked
again in the background of a server (`segue serve` turns it on; RECHECK_ENV): a thread at the
lowest priority, after the start has answered, times it again and saves it for the next start when
it decides more points. It never changes the plan of the running process.
"""
from __future__ import annotations

import copy
import dataclasses
import fcntl
import hashlib
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

logger = logging.getLogger(__name__)


@dataclass
class MeasuredTable:
    key: dict[str, str]
    # What was timed -> candidate -> ladder point -> ms per call
    timings_ms: dict[str, Any]
    # Timed while the process waited for its CPUs, or with pairs left undecided (informational:
    # the decisions already keep the default where the noise hid the difference).
    noisy: bool = False
    # What was timed -> ladder point -> "a/b" -> (median, lo, hi) of the paired time ratio
    # (timing.Ratios). Empty in a table written by hand: its decisions then read the medians.
    ratios: dict[str, dict[str, dict[str, tuple[float, float, float]]]] = field(default_factory=dict)

    def ratios_at(self, what: str, point: object) -> dict[str, tuple[float, float, float]] | None:
        """The paired intervals of one point: None in a table written by hand (decide by the
        medians), empty where the timing was disturbed (decide nothing: the default)."""
        if what not in self.ratios:
            return None
        return self.ratios[what].get(str(point), {})

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=1)

    @classmethod
    def from_json(cls: type[T], text: str) -> T:
        raw = json.loads(text)
        ratios = {what: {point: {pair: (r[0], r[1], r[2]) for pair, r in pairs.items()}
                         for point, pairs in points.items()} for what, points in raw.get("ratios", {}).items()}
        return cls(raw["key"], cls.timings_from_json(raw["timings_ms"]), bool(raw.get("noisy", False)), ratios)

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
    """The cached table of `key`, or None: none yet, unreadable or another key's."""
    path = cached_path(kind, key)
    try:
        table = table_type.from_json(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError, IndexError) as e:
        logger.warning("ignoring an unreadable kernel table %s (%s)", path, e)
        return None
    return table if table.key == key else None


@contextmanager
def _measuring(kind: str, key: dict[str, str]) -> Iterator[None]:
    """Held while one process measures and saves `key`'s table: another process (a replica)
    waits here instead of timing beside it, which would disturb both measurements."""
    path = cached_path(kind, key).with_suffix(".lock")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:  # a read-only cache: measure unlocked, as nothing can be shared anyway
        logger.warning("could not lock %s (%s): measuring without it", path, e)
        yield
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            t0 = time.perf_counter()
            logger.info("another process is measuring the %s table: waiting for it", kind)
            fcntl.flock(fd, fcntl.LOCK_EX)
            logger.info("waited %.1f s for the %s table", time.perf_counter() - t0, kind)
        yield
    finally:
        os.close(fd)  # releases the lock


# Set (to anything but "0") to re-check noisy tables in the background; cli.py's serve sets it.
RECHECK_ENV = "SEGUE_TABLE_RECHECK"
# The first re-check waits this long after the table was loaded (a start's first answers come
# first), each later one longer; a check whose timings the server's own work disturbed decides
# nothing and is tried again.
RECHECK_DELAY_S = 120.0
RECHECK_ATTEMPTS = 3
_rechecking: set[tuple[str, str]] = set()


def decided_points(table: MeasuredTable) -> int:
    """How many of the table's points hold intervals to decide by."""
    return sum(1 for points in table.ratios.values() for pairs in points.values() if pairs)


def disturbed_points(table: MeasuredTable) -> int:
    """How many points decided nothing, timed while the process waited for its CPUs (a pair that
    stayed within the margin on a quiet machine is a tie, and checking again would not settle it)."""
    return sum(1 for points in table.ratios.values() for pairs in points.values() if not pairs)


def merge_settled(current: T, fresh: T) -> T:
    """`current` with the points it left undecided and `fresh` decided taken from `fresh` (their
    intervals and medians); a point both decided keeps `current`'s, so a plan changes only where
    the earlier timing could say nothing."""
    merged = copy.deepcopy(current)
    for what, points in fresh.ratios.items():
        for point, pairs in points.items():
            if not pairs or merged.ratios.get(what, {}).get(point):
                continue
            merged.ratios.setdefault(what, {})[point] = pairs
            for candidate, by_point in fresh.timings_ms.get(what, {}).items():
                for p, ms in by_point.items():
                    if str(p) == point:
                        merged.timings_ms.setdefault(what, {}).setdefault(candidate, {})[p] = ms
    merged.noisy = bool(disturbed_points(merged)) or (current.noisy and fresh.noisy)
    return merged


def _recheck(kind: str, key: dict[str, str], table_type: type[T], measure: Callable[[T | None], T],
             held: T) -> None:
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)  # Linux: this thread alone
    except (AttributeError, OSError) as e:
        logger.info("the %s table's re-check runs at normal priority (%s)", kind, e)
    for attempt in range(1, RECHECK_ATTEMPTS + 1):
        time.sleep(RECHECK_DELAY_S * attempt)
        with _measuring(kind, key):
            current = _load(kind, key, table_type) or held
            if not disturbed_points(current):   # another process settled it meanwhile
                return
            merged = merge_settled(current, measure(current))
            gained = decided_points(merged) - decided_points(current)
            if gained > 0:
                save(kind, merged)
                logger.info("background re-check of the %s table decided %d more points: saved for the next start",
                            kind, gained)
            current = merged
        if not disturbed_points(current):
            return
    logger.info("background re-check of the %s table: still disturbed after %d tries", kind, RECHECK_ATTEMPTS)


def _schedule_recheck(kind: str, key: dict[str, str], table_type: type[T], measure: Callable[[T | None], T],
                      table: T) -> None:
    memo_key = (kind, json.dumps(key, sort_keys=True))
    if not disturbed_points(table) or os.environ.get(RECHECK_ENV, "0") == "0" or memo_key in _rechecking:
        return
    _rechecking.add(memo_key)
    threading.Thread(target=_recheck, args=(kind, key, table_type, measure, table), name=f"segue-recheck-{kind}",
                     daemon=True).start()


_memo: dict[tuple[str, str], MeasuredTable] = {}
# Engines built on threads of one process measure a key once too.
_process_lock = threading.RLock()


def clear_memo() -> None:
    _memo.clear()


def cached_table(kind: str, key: dict[str, str], table_type: type[T], measure: Callable[[T | None], T],
                 usable: Callable[[T], bool] = lambda table: True, remeasure: bool = False) -> T:
    """This process's table of `key`, else the cached one, else `measure(stale)` (saved): `stale`
    is a cached table of this key that was not `usable` (one that lacks candidates asked for now),
    or None. `remeasure`: measure now whatever is cached."""
    memo_key = (kind, json.dumps(key, sort_keys=True))
    with _process_lock:
        held = _memo.get(memo_key)
        if not remeasure and isinstance(held, table_type) and usable(held):
            return held
        loaded = None if remeasure else _load(kind, key, table_type)
        if loaded is None or not usable(loaded):
            with _measuring(kind, key):
                # Another process may have saved it while this one waited for the lock.
                again = None if remeasure else _load(kind, key, table_type)
                stale = again if again is not None else loaded
                if again is not None and usable(again):
                    loaded = again
                else:
                    loaded = measure(stale)
                    save(kind, loaded)
        _memo[memo_key] = loaded
        _schedule_recheck(kind, key, table_type, measure, loaded)
        return loaded
