"""Open-loop arrival processes: when requests arrive, whatever the server's progress.

Poisson arrivals have exponential gaps (CV 1). Gamma gaps keep the mean rate but set the
coefficient of variation: CV > 1 is burstier than Poisson (agent swarms, retries), CV < 1 more
regular (a paced load generator). Both are seeded numpy streams, so one seed reproduces a run.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np

ArrivalKind = Literal["poisson", "gamma"]


@dataclass(frozen=True)
class ArrivalProcess:
    rate: float  # mean requests per second
    kind: ArrivalKind = "poisson"
    cv: float = 1.0  # gamma only: std / mean of the gaps

    def __post_init__(self) -> None:
        if not self.rate > 0:
            raise ValueError(f"arrival rate must be positive, got {self.rate}")
        if self.kind not in ("poisson", "gamma"):
            raise ValueError(f"unknown arrival process {self.kind!r} (poisson or gamma)")
        if not self.cv > 0:
            raise ValueError(f"coefficient of variation must be positive, got {self.cv}")

    def gaps(self, n: int, rng: np.random.Generator) -> np.ndarray:
        """n inter-arrival gaps in seconds."""
        if self.kind == "poisson":
            return rng.exponential(1.0 / self.rate, size=n)
        # Gamma(shape k, scale θ): mean kθ = 1/rate and CV = 1/sqrt(k).
        shape = 1.0 / (self.cv * self.cv)
        return rng.gamma(shape, 1.0 / (self.rate * shape), size=n)

    def times(self, n: int, rng: np.random.Generator | int) -> list[float]:
        """Offsets (s) from the start of the run of n arrivals; the first comes one gap in."""
        if isinstance(rng, (int, np.integer)):
            rng = np.random.default_rng(int(rng))
        return np.cumsum(self.gaps(n, rng)).tolist()

    def describe(self) -> str:
        return f"poisson {self.rate:g} req/s" if self.kind == "poisson" else \
            f"gamma {self.rate:g} req/s, CV {self.cv:g}"
