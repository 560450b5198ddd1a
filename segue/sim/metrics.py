"""Request-level latency and throughput metrics.

One definition of TTFT, TPOT and friends, shared by the offline benchmarks, the server's metrics and the
simulator, so numbers from the three are comparable. All times are `time.monotonic()` seconds.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

DEFAULT_PERCENTILES: tuple[float, ...] = (50.0, 90.0, 99.0)


@dataclass(frozen=True)
class RequestRecord:
    """What one finished request looked like from the outside."""

    arrival_time: float
    first_token_time: float
    finish_time: float
    prompt_tokens: int
    output_tokens: int
    # Seconds the request spent parked inside interceptions (tool calls the engine waits on). Not the
    # engine's fault, so normalized latency subtracts it.
    intercepted_time: float = 0.0

    def __post_init__(self) -> None:
        if not self.arrival_time <= self.first_token_time <= self.finish_time:
            raise ValueError(f"times out of order: arrival {self.arrival_time}, first token "
                             f"{self.first_token_time}, finish {self.finish_time}")
        if self.output_tokens < 1 or self.prompt_tokens < 0:
            raise ValueError("a finished request has at least one output token and no negative prompt")
        if self.intercepted_time < 0:
            raise ValueError("intercepted_time must be >= 0")

    @classmethod
    def from_output(cls, output: Any) -> RequestRecord:
        """From a finished `segue.outputs.RequestOutput` (duck-typed to keep this module import-light).
        Output tokens are the generated ones; tokens appended by interceptions do not count."""
        m = output.metrics
        if m.first_token_time is None or m.finished_time is None:
            raise ValueError(f"request {output.request_id} has not produced a token and finished")
        completion = output.outputs[0]
        generated = completion.num_generated_tokens or len(completion.token_ids)
        return cls(m.arrival_time, m.first_token_time, m.finished_time, len(output.prompt_token_ids),
                   generated, m.intercepted_time)


def ttft(r: RequestRecord) -> float:
    """Time to first token: queueing plus prefill."""
    return r.first_token_time - r.arrival_time


def tpot(r: RequestRecord) -> float | None:
    """Time per output token after the first; None for single-token outputs, where it is undefined."""
    if r.output_tokens < 2:
        return None
    return (r.finish_time - r.first_token_time) / (r.output_tokens - 1)


def e2e_latency(r: RequestRecord) -> float:
    return r.finish_time - r.arrival_time


def normalized_latency(r: RequestRecord) -> float:
    """Seconds per output token of engine-attributable latency, comparable across output lengths."""
    return (e2e_latency(r) - r.intercepted_time) / r.output_tokens


def percentiles(values: Iterable[float], qs: Sequence[float] = DEFAULT_PERCENTILES) -> dict[str, float]:
    """{"p50": ..., "p90": ..., "p99": ...} with numpy's linear interpolation."""
    arr = np.asarray(list(values), dtype=np.float64)
    if arr.size == 0:
        raise ValueError("percentiles of an empty sequence")
    got = np.percentile(arr, list(qs))
    return {f"p{q:g}": float(v) for q, v in zip(qs, got, strict=True)}


def span(records: Sequence[RequestRecord]) -> float:
    """First arrival to last finish: the wall time the workload occupied."""
    if not records:
        return 0.0
    return max(r.finish_time for r in records) - min(r.arrival_time for r in records)


def output_throughput(records: Sequence[RequestRecord], duration: float | None = None) -> float:
    """Generated tokens per second over `duration` (default: the records' span)."""
    return _rate(sum(r.output_tokens for r in records), records, duration)


def total_throughput(records: Sequence[RequestRecord], duration: float | None = None) -> float:
    """Prompt plus generated tokens per second."""
    return _rate(sum(r.prompt_tokens + r.output_tokens for r in records), records, duration)


def request_throughput(records: Sequence[RequestRecord], duration: float | None = None) -> float:
    return _rate(len(records), records, duration)


def _rate(count: float, records: Sequence[RequestRecord], duration: float | None) -> float:
    duration = span(records) if duration is None else duration
    # A zero-length window happens only with empty or degenerate input; NaN beats a ZeroDivisionError
    # in the middle of a long benchmark.
    return count / duration if duration > 0 else math.nan


@dataclass(frozen=True)
class Distribution:
    mean: float
    p50: float
    p90: float
    p99: float

    @classmethod
    def of(cls, values: Iterable[float | None]) -> Distribution | None:
        """Summary of the defined values; None when there are none (e.g. TPOT of 1-token outputs)."""
        kept = [v for v in values if v is not None]
        if not kept:
            return None
        p = percentiles(kept)
        return cls(float(np.mean(kept)), p["p50"], p["p90"], p["p99"])


@dataclass(frozen=True)
class MetricsSummary:
    num_requests: int
    duration_s: float
    prompt_tokens: int
    output_tokens: int
    output_throughput: float  # output tokens / s
    total_throughput: float  # (prompt + output) tokens / s
    request_throughput: float  # requests / s
    ttft: Distribution | None
    tpot: Distribution | None
    e2e_latency: Distribution | None
    normalized_latency: Distribution | None

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-ready dict; NaN becomes None because strict JSON has no NaN."""
        return _json_safe(dataclasses.asdict(self))


def summarize(records: Sequence[RequestRecord], duration: float | None = None) -> MetricsSummary:
    duration = span(records) if duration is None else duration
    return MetricsSummary(
        num_requests=len(records),
        duration_s=duration,
        prompt_tokens=sum(r.prompt_tokens for r in records),
        output_tokens=sum(r.output_tokens for r in records),
        output_throughput=output_throughput(records, duration),
        total_throughput=total_throughput(records, duration),
        request_throughput=request_throughput(records, duration),
        ttft=Distribution.of(ttft(r) for r in records),
        tpot=Distribution.of(tpot(r) for r in records),
        e2e_latency=Distribution.of(e2e_latency(r) for r in records),
        normalized_latency=Distribution.of(normalized_latency(r) for r in records),
    )


def _json_safe(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value
