"""What the LAMPS policy learns from the traffic it schedules: completed segment lengths (the
fallback prediction and the residual life of a request past its prediction), interception odds and
durations, and the batch estimates (τ, C_other, batch size) behind its scores. Pure Python."""
from __future__ import annotations

import bisect
from collections import deque
from dataclasses import dataclass, field
from itertools import accumulate

# Completed segment lengths kept for the residual-life estimate: recent traffic, bounded memory.
_LENGTH_WINDOW = 4096
# Weight of the newest step in the batch estimates: follows load changes within ~10 steps.
_EMA = 0.1


@dataclass
class ObservedTraffic:
    """Running statistics behind the fallbacks and the batch estimates."""
    segments: int = 0
    segment_tokens: float = 0.0
    intercepted_segments: int = 0
    ended_interceptions: int = 0
    interception_s: float = 0.0
    batch_tokens: float | None = None
    batch_context: float = 0.0
    batch_seqs: float = 1.0
    lengths: deque[int] = field(default_factory=lambda: deque(maxlen=_LENGTH_WINDOW))
    _sorted: list[int] | None = None
    _suffix: list[int] = field(default_factory=list)  # _suffix[i] = sum(_sorted[i:])

    def observe_length(self, tokens: int) -> None:
        self.lengths.append(tokens)
        self._sorted = None

    def mean_residual(self, done: float) -> float | None:
        """E[L - done | L > done] over the completed segments seen: how much longer a segment that
        has already produced `done` tokens runs, judged by the lengths of those that got that far."""
        if self._sorted is None:
            self._sorted = sorted(self.lengths)
            self._suffix = list(accumulate(reversed(self._sorted)))[::-1] + [0]
        i = bisect.bisect_right(self._sorted, done)
        longer = len(self._sorted) - i
        return (self._suffix[i] - done * longer) / longer if longer else None

    def mean_segment_tokens(self) -> float | None:
        return self.segment_tokens / self.segments if self.segments else None

    def interception_odds(self) -> tuple[float, float]:
        """(probability that a segment ends in an interception, mean duration)."""
        if not self.segments:
            return 0.0, 0.0
        mean_s = self.interception_s / self.ended_interceptions if self.ended_interceptions else 0.0
        return self.intercepted_segments / self.segments, mean_s

    def record_step(self, tokens: int, context: int, seqs: int) -> None:
        if self.batch_tokens is None:
            self.batch_tokens, self.batch_context, self.batch_seqs = float(tokens), float(context), float(seqs)
            return
        self.batch_tokens += _EMA * (tokens - self.batch_tokens)
        self.batch_context += _EMA * (context - self.batch_context)
        self.batch_seqs += _EMA * (seqs - self.batch_seqs)
