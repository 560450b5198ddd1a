"""Ridge regression over a sliding window of observations, refit when asked after new data.

A window (not all history) lets the model follow drift in the traffic; ridge (not plain least
squares) keeps it stable while there are fewer samples than features. Features are standardized
inside the window so one alpha suits features of any scale (log lengths, hidden-state
projections); the intercept is the window's mean target and is never shrunk, so with one
sample or constant features the prediction is simply that mean.
"""
from __future__ import annotations

import numpy as np


class OnlineRidge:
    def __init__(self, dim: int, window: int = 512, alpha: float = 1.0) -> None:
        if dim < 1 or window < 1 or not alpha > 0:
            raise ValueError(f"need dim >= 1, window >= 1, alpha > 0 (got {dim}, {window}, {alpha})")
        self.dim = dim
        self.window = window
        self.alpha = alpha
        self._x = np.zeros((window, dim))
        self._y = np.zeros(window)
        self.num_observed = 0  # ever, not just the window
        self._fitted_at = 0
        self._mu = np.zeros(dim)
        self._sd = np.ones(dim)
        self._w: np.ndarray = np.zeros(dim)
        self._b = 0.0

    @property
    def num_samples(self) -> int:
        return min(self.num_observed, self.window)

    def observe(self, x: np.ndarray, y: float) -> None:
        x = np.asarray(x, dtype=np.float64)
        if x.shape != (self.dim,):
            raise ValueError(f"expected a feature vector of shape ({self.dim},), got {x.shape}")
        if not (np.all(np.isfinite(x)) and np.isfinite(y)):
            raise ValueError("features and target must be finite")
        i = self.num_observed % self.window
        self._x[i] = x
        self._y[i] = y
        self.num_observed += 1

    def predict(self, x: np.ndarray) -> float | None:
        """None before the first observation."""
        if self.num_observed == 0:
            return None
        if self._fitted_at != self.num_observed:
            self._fit()
        z = (np.asarray(x, dtype=np.float64) - self._mu) / self._sd
        return float(self._b + z @ self._w)

    def _fit(self) -> None:
        n = self.num_samples
        x, y = self._x[:n], self._y[:n]
        self._mu = x.mean(axis=0)
        sd = x.std(axis=0)
        # Constant features carry nothing; scale 1 keeps them at zero without dividing by zero.
        self._sd = np.where(sd > 1e-9, sd, 1.0)
        z = (x - self._mu) / self._sd
        self._b = float(y.mean())
        gram = z.T @ z
        gram[np.diag_indices_from(gram)] += self.alpha
        self._w = np.linalg.solve(gram, z.T @ (y - self._b))
        self._fitted_at = self.num_observed
