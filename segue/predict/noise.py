"""Gaussian error injection for sensitivity studies (LAMPS §6.4).

LAMPS perturbs a value v as v + e with e ~ N(0, (sigma * v)^2): the spread is relative to the
value, so one sigma means the same to a 10-token and a 1000-token answer. Here the perturbed value
is the prediction the policies will read; results are clipped at 0 (no negative lengths or
durations).
"""
from __future__ import annotations

import numpy as np


class GaussianNoise:
    def __init__(self, sigma: float = 0.0, seed: int = 0) -> None:
        if not sigma >= 0:
            raise ValueError(f"noise sigma must be >= 0, got {sigma!r}")
        self.sigma = float(sigma)
        self._rng = np.random.default_rng(seed)

    def apply(self, value: float) -> float:
        if self.sigma == 0.0:
            return value
        return max(0.0, value + float(self._rng.normal(0.0, self.sigma * abs(value))))
