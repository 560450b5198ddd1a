"""Observed tool durations, per tool name, for the scheduler's interception policy.

The engine thread reads these while the event loop that runs tools writes them, so every access
takes one lock. Reads (expected/quantile) happen far more often than writes (one per tool call), so
the window is kept sorted: a write costs O(window) list shifting, a read O(1).
"""
from __future__ import annotations

import bisect
import collections
import math
import threading
from dataclasses import dataclass


@dataclass(frozen=True)
class DurationSummary:
    name: str
    count: int  # observations ever made, not just the window
    mean: float  # over the window: recent behaviour is what predicts the next call
    p50: float
    p90: float
    p99: float
    max: float


class DurationWindow:
    """The last `size` durations, in arrival order (to evict) and sorted (to answer quantiles)."""

    __slots__ = ("size", "order", "sorted", "total", "count")

    def __init__(self, size: int) -> None:
        self.size = size
        self.order: collections.deque[float] = collections.deque()
        self.sorted: list[float] = []
        self.total = 0.0
        self.count = 0

    def add(self, x: float) -> None:
        if len(self.order) == self.size:
            old = self.order.popleft()
            del self.sorted[bisect.bisect_left(self.sorted, old)]
            self.total -= old
        self.order.append(x)
        bisect.insort(self.sorted, x)
        self.total += x
        self.count += 1
        if self.count % self.size == 0:
            # Re-sum now and then so float drift from add/subtract cannot accumulate.
            self.total = math.fsum(self.order)

    def mean(self) -> float:
        return self.total / len(self.order)

    def quantile(self, q: float) -> float:
        # Linear interpolation between closest ranks (numpy's default method).
        s = self.sorted
        pos = q * (len(s) - 1)
        lo = math.floor(pos)
        hi = min(lo + 1, len(s) - 1)
        return s[lo] + (s[hi] - s[lo]) * (pos - lo)


class DurationStats:
    """Running duration statistics per tool: count, window mean, window quantiles, and hints."""

    def __init__(self, window: int = 1000) -> None:
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        self.window = window
        self._lock = threading.Lock()
        self._data: dict[str, DurationWindow] = {}
        self._hints: dict[str, float] = {}

    def observe(self, name: str, seconds: float) -> None:
        if not math.isfinite(seconds) or seconds < 0:
            raise ValueError(f"duration must be a finite number >= 0, got {seconds!r}")
        with self._lock:
            w = self._data.get(name)
            if w is None:
                w = self._data[name] = DurationWindow(self.window)
            w.add(float(seconds))

    def set_hint(self, name: str, seconds: float | None) -> None:
        """The spec's expected_seconds: what expected() answers before any observation."""
        with self._lock:
            if seconds is None:
                self._hints.pop(name, None)
            else:
                self._hints[name] = float(seconds)

    def count(self, name: str) -> int:
        with self._lock:
            w = self._data.get(name)
            return w.count if w else 0

    def mean(self, name: str) -> float | None:
        with self._lock:
            w = self._data.get(name)
            return w.mean() if w else None

    def quantile(self, name: str, q: float) -> float | None:
        """The q-quantile (0 <= q <= 1) of the windowed durations; None before any observation."""
        if not 0.0 <= q <= 1.0:
            raise ValueError(f"quantile must be in [0, 1], got {q!r}")
        with self._lock:
            w = self._data.get(name)
            return w.quantile(q) if w else None

    def expected(self, name: str, default: float | None = None) -> float | None:
        """Best guess of the next call's duration: the window mean, else the hint, else `default`."""
        with self._lock:
            w = self._data.get(name)
            if w is not None:
                return w.mean()
            return self._hints.get(name, default)

    def summary(self, name: str) -> DurationSummary | None:
        with self._lock:
            w = self._data.get(name)
            return self._summarize(name, w) if w else None

    def snapshot(self) -> dict[str, DurationSummary]:
        """Every observed tool's summary, taken under one lock hold (a consistent view)."""
        with self._lock:
            return {name: self._summarize(name, w) for name, w in self._data.items()}

    def names(self) -> list[str]:
        with self._lock:
            return sorted(self._data)

    @staticmethod
    def _summarize(name: str, w: DurationWindow) -> DurationSummary:
        return DurationSummary(name=name, count=w.count, mean=w.mean(), p50=w.quantile(0.5),
                               p90=w.quantile(0.9), p99=w.quantile(0.99), max=w.sorted[-1])
