"""Prometheus metrics at /metrics.

Server-side events (requests, latencies, tool calls) are counted as they happen. Engine state
(queues, KV, waste, preemptions, prefix cache, tool durations) is read at scrape time in one
EngineClient GetStats call: a consistent snapshot between steps, and no per-step cost.
Each app has its own registry so several apps (tests) can share a process.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Iterator, Protocol

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from segue.engine.calls import GetStats
from segue.engine.stats import AccuracySnapshot, EngineStats, PausedKV

if TYPE_CHECKING:
    from segue.engine.protocol import EngineClient
    from segue.server.limits import ConcurrencyLimiter
    from segue.server.sessions import SessionStore
    from segue.tools.registry import ToolRegistry


class MetricsSource(Protocol):
    """What the metrics read of the serving context (context.py builds the metrics, so they name
    only this, not the context)."""
    engine: "EngineClient"
    sessions: "SessionStore"
    limiter: "ConcurrencyLimiter"
    tools: "ToolRegistry"

_ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/models", "/v1/sessions", "/health", "/metrics")
_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1)
_E2E_BUCKETS = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)


def endpoint_label(path: str) -> str:
    # Bounded label values: raw paths (session ids, typos, scanners) would grow the series forever.
    for known in _ENDPOINTS:
        if path == known or path.startswith(known + "/"):
            return known
    return "other"


class _EngineCollector:
    """Turns the latest snapshot into metric families (prometheus_client calls collect())."""

    def __init__(self, ctx: MetricsSource) -> None:
        self.ctx = ctx
        self.snapshot: EngineStats | None = None

    def collect(self) -> Iterator[Metric]:
        sessions = GaugeMetricFamily("segue_sessions", "Open sessions, by whether they hold a paused request",
                                     labels=["state"])
        for state, n in self.ctx.sessions.counts().items():
            sessions.add_metric([state], n)
        yield sessions
        yield GaugeMetricFamily("segue_requests_in_flight", "Generation requests admitted and not yet answered",
                                value=self.ctx.limiter.in_flight)
        snap = self.snapshot
        if snap is None:
            return
        queues = GaugeMetricFamily("segue_queue_requests", "Engine requests by queue", labels=["queue"])
        for name in ("running", "waiting", "paused", "swapped"):
            queues.add_metric([name], getattr(snap, name))
        yield queues
        blocks = GaugeMetricFamily("segue_kv_blocks", "KV cache blocks in use and in total", labels=["pool", "kind"])
        for pool in ("device", "host"):
            blocks.add_metric([pool, "used"], getattr(snap, f"{pool}_blocks_used"))
            blocks.add_metric([pool, "total"], getattr(snap, f"{pool}_blocks_total"))
        yield blocks
        paused_req = GaugeMetricFamily("segue_paused_requests", "Paused requests by KV disposition",
                                       labels=["disposition"])
        paused_blocks = GaugeMetricFamily("segue_paused_kv_blocks", "KV blocks of paused requests by disposition",
                                          labels=["disposition", "pool"])
        for disposition in ("preserve", "swap", "discard"):
            kv = snap.paused_kv.get(disposition, PausedKV())
            paused_req.add_metric([disposition], kv.requests)
            paused_blocks.add_metric([disposition, "device"], kv.device_blocks)
            paused_blocks.add_metric([disposition, "host"], kv.host_blocks)
        yield paused_req
        yield paused_blocks
        waste = CounterMetricFamily("segue_kv_waste_gb_seconds", "Device KV held without producing tokens (GB*s)",
                                    labels=["cause"])
        for cause in ("preserved_idle", "recompute", "swap_stall"):
            waste.add_metric([cause], snap.waste[f"{cause}_gbs"])
        yield waste
        yield CounterMetricFamily("segue_preemptions", "Scheduler preemptions", value=snap.preemptions)
        yield CounterMetricFamily("segue_prefix_cache_hit_tokens", "Prompt tokens served by the prefix cache",
                                  value=snap.prefix_hit_tokens)
        yield CounterMetricFamily("segue_prefix_cache_query_tokens", "Prompt tokens looked up in the prefix cache",
                                  value=snap.prefix_query_tokens)
        yield CounterMetricFamily("segue_engine_steps", "Engine steps", value=snap.steps)
        yield CounterMetricFamily("segue_engine_step_seconds", "Seconds the executor took for the engine's steps",
                                  value=snap.step_seconds)
        yield CounterMetricFamily("segue_engine_modelled_step_seconds",
                                  "What the cost model (the profile) charges the same steps",
                                  value=snap.modelled_step_seconds)
        durations = GaugeMetricFamily("segue_tool_duration_seconds",
                                      "Observed tool (interception) durations over the recent window",
                                      labels=["tool", "stat"])
        counts = CounterMetricFamily("segue_tool_duration_observations", "Tool durations observed", labels=["tool"])
        for name, summary in snap.tools.items():
            for stat in ("mean", "p50", "p90", "p99", "max"):
                durations.add_metric([name, stat], getattr(summary, stat))
            counts.add_metric([name], summary.count)
        yield durations
        yield counts
        yield from _predictor_families(snap.predictors)


def _predictor_families(predictors: dict[str, AccuracySnapshot]) -> Iterator[Metric]:
    """Accuracy of each online predictor over every prediction it has had scored (LAMPS §6.4)."""
    samples = CounterMetricFamily("segue_predictor_samples", "Predictions scored against the measured value",
                                  labels=["predictor"])
    mae = GaugeMetricFamily("segue_predictor_mae", "Mean absolute error of the predictions (tokens for "
                            "output lengths, seconds for tool durations)", labels=["predictor"])
    acc = GaugeMetricFamily("segue_predictor_accuracy", "Fraction of predictions within `tolerance` of the "
                            "measured value (LAMPS Acc-5, Acc-15; tokens or seconds)",
                            labels=["predictor", "tolerance"])
    for name, snap in predictors.items():
        samples.add_metric([name], snap.count)
        if snap.mae is None:  # nothing scored yet: no made-up zeros
            continue
        mae.add_metric([name], snap.mae)
        for k, frac in snap.within:
            if frac is not None:  # scored predictions exist (mae above), so every fraction is known
                acc.add_metric([name, f"{k:g}"], frac)
    yield samples
    yield mae
    yield acc


class ServerMetrics:
    def __init__(self, ctx: MetricsSource) -> None:
        self.ctx = ctx
        self.registry = CollectorRegistry(auto_describe=False)
        r = self.registry
        self.http = Counter("segue_http_requests", "HTTP requests by endpoint and status", ["endpoint", "status"],
                            registry=r)
        self.ttft = Histogram("segue_time_to_first_token_seconds", "Time to first token", ["endpoint"],
                              buckets=_TTFT_BUCKETS, registry=r)
        self.tpot = Histogram("segue_time_per_output_token_seconds",
                              "Time per output token after the first (server-side tool time excluded)",
                              ["endpoint"], buckets=_TPOT_BUCKETS, registry=r)
        self.e2e = Histogram("segue_e2e_request_latency_seconds", "Request latency, end to end", ["endpoint"],
                             buckets=_E2E_BUCKETS, registry=r)
        self.tool_calls = Counter("segue_tool_calls", "Tool calls by tool, side (server/client) and outcome",
                                  ["tool", "side", "outcome"], registry=r)
        self.engine = _EngineCollector(ctx)
        r.register(self.engine)

    def observe_latency(self, endpoint: str, start: float, first: float | None, end: float, tokens: int,
                        excluded_s: float = 0.0) -> None:
        self.e2e.labels(endpoint).observe(end - start)
        if first is None:
            return
        self.ttft.labels(endpoint).observe(first - start)
        if tokens > 1:
            self.tpot.labels(endpoint).observe(max(0.0, end - first - excluded_s) / (tokens - 1))

    def count_tool_call(self, name: str, side: str, is_error: bool) -> None:
        # Only operator-registered names become label values; model- or client-chosen ones are bounded.
        label = name if side == "server" and name in self.ctx.tools else side
        self.tool_calls.labels(label, side, "error" if is_error else "ok").inc()

    async def render(self) -> bytes:
        try:
            self.engine.snapshot = await self.ctx.engine.call(GetStats())
        except Exception:  # engine gone: still serve the server-side metrics
            self.engine.snapshot = None
        return generate_latest(self.registry)


class HTTPMetricsMiddleware:
    """Counts every response by endpoint and status, errors from other middleware included."""

    def __init__(self, app: ASGIApp, metrics: ServerMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500  # a response that never starts is a server failure (or a client that left)

        async def recording_send(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, recording_send)
        finally:
            self.metrics.http.labels(endpoint_label(scope["path"]), str(status)).inc()
