"""The Markdown report of a comparison: one row per (configuration, rate) and the ratios of each
configuration to the first one at the same rate (the baseline)."""
from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from segue.sim.metrics import RequestRecord

RECORD_FIELDS = ("arrival_time", "first_token_time", "finish_time", "prompt_tokens", "output_tokens",
                 "intercepted_time")


def records_of(row: dict[str, Any]) -> list[RequestRecord]:
    return [RequestRecord(*r) for r in row.get("records") or []]


def metric(row: dict[str, Any], name: str, stat: str = "mean") -> float | None:
    """A number from a row's summary: `name` is a distribution (ttft, tpot, e2e_latency,
    normalized_latency) read at `stat`, or a scalar (output_throughput, ...) when stat is ''."""
    s = row.get("summary") or {}
    v = s.get(name)
    if isinstance(v, dict):
        v = v.get(stat)
    return float(v) if isinstance(v, (int, float)) and math.isfinite(v) else None


def _f(v: float | None, fmt: str) -> str:
    return "n/a" if v is None else fmt.format(v)


def _ratio(v: float | None, base: float | None) -> str:
    return "n/a" if v is None or not base else f"{v / base:.2f}×"


COLUMNS: tuple[tuple[str, str, str, str], ...] = (
    # header, summary field, statistic, format
    ("norm. latency mean (s/tok)", "normalized_latency", "mean", "{:.4f}"),
    ("norm. p99", "normalized_latency", "p99", "{:.4f}"),
    ("TTFT mean (s)", "ttft", "mean", "{:.3f}"),
    ("TTFT p99 (s)", "ttft", "p99", "{:.3f}"),
    ("TPOT mean (ms)", "tpot", "mean", "{:.1f}"),
    ("out tok/s", "output_throughput", "", "{:.1f}"),
    ("req/s", "request_throughput", "", "{:.3f}"),
)


def _cell(row: dict[str, Any], field: str, stat: str, fmt: str) -> str:
    v = metric(row, field, stat)
    if field == "tpot" and v is not None:
        v *= 1000
    return _f(v, fmt)


def max_sustainable_rate(rows: Sequence[dict[str, Any]], slo: float) -> float | None:
    """The highest rate before the first whose mean normalized latency exceeds `slo` or that left
    requests unfinished; None if the lowest rate already misses."""
    best = None
    for r in sorted(rows, key=lambda r: r["rate"]):
        mean = metric(r, "normalized_latency")
        if mean is None or mean > slo or r.get("num_unfinished", 0):
            break
        best = r["rate"]
    return best


def render(rows: Sequence[dict[str, Any]], title: str, workload: str, slo: float | None = None) -> str:
    configs = list(dict.fromkeys(r["config"] for r in rows))
    base_name = configs[0]
    lines = [f"## {title}", "", f"Workload: {workload}.", "",
             "| config | target | rate (req/s) | done | " + " | ".join(c[0] for c in COLUMNS) + " |",
             "|---|---|---:|---:|" + "---:|" * len(COLUMNS)]
    for r in rows:
        done = f"{r['num_finished']}/{r['num_requests']}" + (" (stalled)" if r.get("stalled") else "")
        cells = " | ".join(_cell(r, f, s, fmt) for _, f, s, fmt in COLUMNS)
        lines.append(f"| {r['config']} | {r['label']} | {r['rate']:g} | {done} | {cells} |")
    if len(configs) > 1:
        lines += ["", f"Ratios to **{base_name}** at the same rate (latency: lower is better; throughput: "
                  "higher is better):", "",
                  "| config | rate | norm. latency mean | norm. p99 | TTFT mean | out tok/s |",
                  "|---|---:|---:|---:|---:|---:|"]
        base = {r["rate"]: r for r in rows if r["config"] == base_name}
        for r in rows:
            b = base.get(r["rate"])
            if r["config"] == base_name or b is None:
                continue
            pairs = [("normalized_latency", "mean"), ("normalized_latency", "p99"), ("ttft", "mean"),
                     ("output_throughput", "")]
            cells = " | ".join(_ratio(metric(r, f, s), metric(b, f, s)) for f, s in pairs)
            lines.append(f"| {r['config']} | {r['rate']:g} | {cells} |")
    if slo is not None:
        lines += ["", f"Max sustainable rate (mean normalized latency ≤ {slo:g} s/token, all requests done):", "",
                  "| config | max rate (req/s) |", "|---|---:|"]
        for c in configs:
            best = max_sustainable_rate([r for r in rows if r["config"] == c], slo)
            lines.append(f"| {c} | {_f(best, '{:g}') if best is not None else '< lowest'} |")
    errors = [(r["config"], r["rate"], e) for r in rows for e in r.get("errors", [])[:3]]
    if errors:
        lines += ["", "Errors (first few per run):", ""] + [f"- {c} @ {rate:g}: {e}" for c, rate, e in errors]
    return "\n".join(lines)
