"""Output-length predictor: tokens a segment will generate, learned online from finished segments.

The regression runs in log space: lengths are heavy-tailed, a log target keeps one 2000-token
answer from dominating the fit, and the back-transform can never go negative.
"""
from __future__ import annotations

import math

import numpy as np

from segue.predict.regressor import OnlineRidge


class OutputLengthPredictor:
    def __init__(self, dim: int, window: int = 512, alpha: float = 1.0) -> None:
        self.regressor = OnlineRidge(dim, window, alpha)

    @property
    def num_observed(self) -> int:
        return self.regressor.num_observed

    def predict(self, x: np.ndarray, max_tokens: int | None = None) -> float | None:
        """Predicted tokens, in [1, max_tokens] (a segment that runs makes at least one token and
        never more than the request may still make); None before the first observation."""
        log_len = self.regressor.predict(x)
        if log_len is None:
            return None
        tokens = max(1.0, math.expm1(min(log_len, 30.0)))  # 30: e^30 tokens is past any context
        if max_tokens is not None:
            tokens = min(tokens, max(1.0, float(max_tokens)))
        return tokens

    def observe(self, x: np.ndarray, tokens: int) -> None:
        self.regressor.observe(x, math.log1p(max(0, tokens)))
