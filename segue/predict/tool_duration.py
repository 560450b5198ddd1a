"""Tool-duration predictor: a running quantile of each tool's observed durations.

LAMPS observes that durations within one API type vary little, so per-tool statistics are the
predictor. The per-tool windows are the engine's own DurationStats (shared with the interception
policies); this keeps one more window over every interception, the fallback for a tool never
seen before (or an interception with no tool name, such as a human turn).
"""
from __future__ import annotations

from segue.tools.stats import DurationStats

_ALL = "*"


class ToolDurationPredictor:
    def __init__(self, stats: DurationStats, quantile: float = 0.5, window: int = 1000) -> None:
        if not 0.0 <= quantile <= 1.0:
            raise ValueError(f"tool quantile must be in [0, 1], got {quantile!r}")
        self.stats = stats
        self.quantile = quantile
        self._all = DurationStats(window)

    def predict(self, tool: str | None, hint_s: float | None = None) -> float | None:
        """The caller's hint, else the tool's quantile, else its configured expected_seconds,
        else the quantile over all interceptions; None before anything is known."""
        if hint_s is not None:
            return float(hint_s)
        if tool is not None:
            q = self.stats.quantile(tool, self.quantile)
            if q is None:
                q = self.stats.expected(tool)
            if q is not None:
                return q
        return self._all.quantile(_ALL, self.quantile)

    def observe(self, seconds: float) -> None:
        """Every finished interception (the engine feeds per-tool windows itself)."""
        self._all.observe(_ALL, seconds)
