"""How good a predictor is: MAE and Acc-k as LAMPS §6.4 defines them.

Acc-k is the fraction of predictions that differ from the measured value by no more than k (LAMPS
counts words; we count in the predictor's own unit: tokens for output lengths, seconds for tool
durations). Counts are cumulative since start, so they can be exported as Prometheus counters and
rated over any window by the scraper.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

# LAMPS reports Acc-5 and Acc-15.
DEFAULT_TOLERANCES: tuple[float, ...] = (5.0, 15.0)


@dataclass(frozen=True)
class AccuracySnapshot:
    name: str
    count: int
    mae: float | None  # None before the first scored prediction
    # (k, fraction of predictions with |predicted - actual| <= k), one per tolerance.
    within: tuple[tuple[float, float | None], ...]

    def acc(self, k: float) -> float | None:
        for tol, frac in self.within:
            if tol == k:
                return frac
        raise KeyError(f"{self.name} does not track Acc-{k:g}")


class AccuracyTracker:
    def __init__(self, name: str, tolerances: tuple[float, ...] = DEFAULT_TOLERANCES) -> None:
        if any(k < 0 for k in tolerances):
            raise ValueError(f"tolerances must be >= 0, got {tolerances}")
        self.name = name
        self.tolerances = tuple(tolerances)
        self.count = 0
        self.abs_error_sum = 0.0
        self.num_within = [0] * len(self.tolerances)

    def record(self, predicted: float, actual: float) -> None:
        if not (math.isfinite(predicted) and math.isfinite(actual)):
            raise ValueError(f"predicted and actual must be finite, got {predicted!r}, {actual!r}")
        err = abs(predicted - actual)
        self.count += 1
        self.abs_error_sum += err
        for i, k in enumerate(self.tolerances):
            if err <= k:
                self.num_within[i] += 1

    @property
    def mae(self) -> float | None:
        return self.abs_error_sum / self.count if self.count else None

    def snapshot(self) -> AccuracySnapshot:
        n = self.count
        within = zip(self.tolerances, self.num_within, strict=True)
        return AccuracySnapshot(self.name, n, self.mae, tuple((k, (w / n if n else None)) for k, w in within))
