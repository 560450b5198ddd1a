"""Open-loop trace replay: requests arrive on a schedule whatever the engine's progress, as users
and agents do. One driver serves the real engine (wall clock, sleeps while idle) and the simulator
(virtual clock, jumps while idle), so their numbers are computed the same way."""
from __future__ import annotations

import math
import random
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from segue.engine.engine_request import EngineRequest
from segue.engine.memory_waste import WasteTotals
from segue.sampling_params import SamplingParams
from segue.sim.metrics import RequestRecord, summarize
from segue.sim.script import scripted
from segue.sim.workloads.trace_request import TraceRequest


# ---- the driver ----------------------------------------------------------------------------
@dataclass
class ReplayResult:
    records: list[RequestRecord]
    num_requests: int
    duration_s: float          # engine-clock seconds from the start to the last finish
    wall_s: float              # real seconds the replay took (simulation speed)
    waste: WasteTotals
    preemptions: int
    steps: int
    # Requests still unfinished when the driver stopped (a deadline or a stall); normally 0.
    num_unfinished: int = 0
    # The engine sat idle with unfinished requests and nothing to wait for (a scheduler deadlock).
    stalled: bool = False
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def num_finished(self) -> int:
        return len(self.records)

    def to_dict(self, include_records: bool = False) -> dict[str, Any]:
        summary = summarize(self.records, self.duration_s).to_dict() if self.records else None
        d: dict[str, Any] = {
            "num_requests": self.num_requests, "num_finished": self.num_finished,
            "num_unfinished": self.num_unfinished, "stalled": self.stalled, "duration_s": self.duration_s,
            "wall_s": self.wall_s, "steps": self.steps, "preemptions": self.preemptions,
            "waste_gbs": self.waste.as_dict(), "summary": summary, **self.extra,
        }
        if include_records:
            d["records"] = [r.__dict__ for r in self.records]
        return d


def token_range(vocab_size: int) -> tuple[int, int]:
    # Away from the byte and special tokens at both ends of a vocabulary.
    return (1000, vocab_size - 1000) if vocab_size > 4000 else (0, vocab_size)


def replay(engine: Any, requests: Sequence[TraceRequest], arrivals: Sequence[float],
           clock_wait: Callable[[float], None], seed: int = 0, progress: bool = False,
           desc: str = "replay", deadline_s: float | None = None) -> ReplayResult:
    """Add requests[i] at start + arrivals[i] (engine clock), step the engine, and wait for the
    next event when nothing can run. `clock_wait(t)` returns once the engine clock reads >= t
    (real: sleep; simulator: advance the virtual clock). `deadline_s` (engine-clock seconds
    after the start) stops a run that will not drain, e.g. an overloaded real engine. A stalled
    engine (idle, requests left, no event to wait for) ends the run with `stalled` set."""
    from tqdm import tqdm

    if len(requests) != len(arrivals):
        raise ValueError("one arrival time per request")
    order = sorted(range(len(requests)), key=lambda i: arrivals[i])
    rng = random.Random(seed)
    vocab = token_range(engine.model_config.vocab_size)
    params = SamplingParams(temperature=0)
    records: list[RequestRecord] = []
    start = engine.clock()
    last_finish = start
    wall0 = time.perf_counter()
    nxt = 0
    stalled = False
    bar = tqdm(total=len(requests), desc=desc, unit="req", file=sys.stderr, disable=not progress,
               dynamic_ncols=True, mininterval=1.0)
    try:
        while nxt < len(order) or engine.has_unfinished_requests():
            now = engine.clock()
            if deadline_s is not None and now - start > deadline_s:
                break
            while nxt < len(order) and start + arrivals[order[nxt]] <= now:
                i = order[nxt]
                prompt, script = requests[i].materialize(rng, vocab)
                # The scheduled arrival, not the moment we got round to it: queueing counts.
                request = EngineRequest(prompt, params, f"r{i}-{requests[i].key}", arrival_time=start + arrivals[i])
                scripted(engine).add_request(request, script)
                nxt += 1
            if engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished:
                        records.append(RequestRecord.from_output(out))
                        last_finish = max(last_finish, out.metrics.finished_time)
                        bar.update(1)
                if not engine.last_step_idle:
                    continue
            events = [t for t in (start + arrivals[order[nxt]] if nxt < len(order) else None,
                                  engine.next_timer()) if t is not None]
            if not events:
                if engine.has_unfinished_requests():
                    stalled = True
                    print(f"{desc}: the engine is idle with {engine.num_unfinished_requests} unfinished "
                          "requests and nothing to wait for; stopping", file=sys.stderr)
                break
            clock_wait(min(events))
    finally:
        bar.close()
    return ReplayResult(records, len(requests), last_finish - start, time.perf_counter() - wall0,
                        engine.waste.totals, engine.scheduler.state.num_preemptions_total, engine.num_steps,
                        num_unfinished=len(requests) - len(records), stalled=stalled)


def real_clock_wait(t: float) -> None:
    """clock_wait for engines on time.monotonic."""
    gap = t - time.monotonic()
    if gap > 0:
        time.sleep(gap)


# ---- reporting shared by `segue sim` and `segue bench intercept` ------------------------------
def _f(v: float | None, fmt: str = "{:.3f}") -> str:
    return "n/a" if v is None or (isinstance(v, float) and not math.isfinite(v)) else fmt.format(v)


def row_metrics(row: dict[str, Any]) -> dict[str, float | None]:
    s = row.get("summary") or {}
    nl, ttft = s.get("normalized_latency") or {}, s.get("ttft") or {}
    return {"norm_mean": nl.get("mean"), "norm_p99": nl.get("p99"), "ttft_mean": ttft.get("mean"),
            "req_s": s.get("request_throughput"), "tok_s": s.get("output_throughput")}


def max_sustainable_rates(rows: Sequence[dict[str, Any]], slo: float) -> dict[str, float | None]:
    """Per policy, the highest rate before the first one whose mean normalized latency exceeds
    `slo` (or that left requests unfinished); None if even the lowest rate misses it."""
    best: dict[str, float | None] = {}
    for policy in dict.fromkeys(r["policy"] for r in rows):
        best[policy] = None
        for r in sorted((r for r in rows if r["policy"] == policy), key=lambda r: r["rate"]):
            mean = row_metrics(r)["norm_mean"]
            if mean is None or mean > slo or r.get("num_unfinished", 0):
                break
            best[policy] = r["rate"]
    return best


def render_markdown(rows: Sequence[dict[str, Any]], slo: float, title: str) -> str:
    lines = [f"## {title}", "",
             "| policy | rate (req/s) | done | norm. latency mean (s/tok) | p99 | TTFT mean (s) | req/s | "
             "out tok/s | waste preserve / recompute / swap / total (GB·s) | preemptions |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---|---:|"]
    for r in rows:
        m, w = row_metrics(r), r["waste_gbs"]
        waste = " / ".join(_f(w[k], "{:.1f}") for k in ("preserved_idle_gbs", "recompute_gbs",
                                                          "swap_stall_gbs", "total_gbs"))
        done = f"{r['num_finished']}/{r['num_requests']}" + (" (stalled)" if r.get("stalled") else "")
        lines.append(f"| {r['policy']} | {r['rate']:g} | {done} | "
                     f"{_f(m['norm_mean'])} | {_f(m['norm_p99'])} | {_f(m['ttft_mean'], '{:.2f}')} | "
                     f"{_f(m['req_s'], '{:.2f}')} | {_f(m['tok_s'], '{:.0f}')} | {waste} | {r['preemptions']} |")
    best = max_sustainable_rates(rows, slo)
    lines += ["", f"Max sustainable rate (mean normalized latency ≤ {slo:g} s/token):", "",
              "| policy | max rate (req/s) |", "|---|---:|"]
    lines += [f"| {p} | {_f(v, '{:g}') if v is not None else '< lowest'} |" for p, v in best.items()]
    mw, dc = best.get("min-waste"), best.get("discard")
    if mw is not None and dc:
        lines += ["", f"min-waste / discard: {mw / dc:.2f}×"]
    elif "min-waste" in best and "discard" in best:
        lines += ["", "min-waste / discard: n/a (a policy missed the SLO at every rate)"]
    return "\n".join(lines)
