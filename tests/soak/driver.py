"""Runs the soak: workers draw scenarios from the mix until the request or time budget is spent, a
monitor checks the engine's invariants and samples memory meanwhile, and at the end the server must
drain to nothing: no requests, no sessions, no KV blocks held on the device or the host.

The verdict (SoakReport.problems) is empty only if there were no 5xx, no in-band stream errors, no
unexpected answers, no hung scenarios, no invariant failures, no leaked blocks and bounded memory
growth after warm-up.
"""
from __future__ import annotations

import asyncio
import dataclasses
import gc
import os
import random
import re
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from .client import Client, Tally
from .scenarios import MIX
from .server import ServerSettings, SoakServer, is_idle, queue_dump, server_probe


@dataclass
class SoakConfig:
    requests: int = 400           # HTTP request budget: no scenario starts once it is spent
    concurrency: int = 16         # client workers, each running one scenario at a time
    seconds: float = 60.0         # time budget for starting scenarios
    seed: int = 0
    policy: str = "min-waste"     # the engine's interception policy (the server's default)
    kv_cache_tokens: int = 2048   # device KV pool (see ServerSettings)
    session_ttl_s: float = 3.0
    request_timeout_s: float = 30.0
    deadline_s: float = 45.0      # a scenario still running after this is hung
    invariant_every_s: float = 2.0
    probe_every_s: float = 0.5    # engine/server state sampled this often for the peaks
    # Requests queued, none running and no engine step for this long: the scheduler is stuck (a
    # working engine schedules a queued request at its next step, or preempts to make room).
    stall_after_s: float = 3.0
    # RSS is compared from the end of warm-up (allocator pools, tokenizer and template caches,
    # torch's per-shape kernels and prometheus series all fill up early) to the end.
    warmup_fraction: float = 0.2
    # A leak proportional to traffic shows up as steady growth after warm-up; 25% of a ~0.5-1 GiB
    # process is far above allocator noise and far below what thousands of leaked requests cost.
    max_rss_growth: float = 0.25


@dataclass
class SoakReport:
    config: dict[str, Any]
    duration_s: float = 0.0
    requests: int = 0
    scenarios: dict[str, int] = field(default_factory=dict)
    statuses: dict[str, int] = field(default_factory=dict)
    faults: dict[str, int] = field(default_factory=dict)
    outcomes: dict[str, int] = field(default_factory=dict)
    server_5xx: int = 0
    server_recorded: dict[str, int] = field(default_factory=dict)  # status -> count, from /metrics
    inband_errors: int = 0
    unexpected: dict[str, int] = field(default_factory=dict)
    unexpected_samples: list[str] = field(default_factory=list)
    hung: int = 0
    invariant_checks: int = 0
    stalls: int = 0
    stall_dumps: list[list[str]] = field(default_factory=list)
    invariant_failures: list[str] = field(default_factory=list)
    drained: bool = False
    # Highest values seen under load: device/host blocks in use, paused and swapped requests, sessions.
    peaks: dict[str, int] = field(default_factory=dict)
    final: dict[str, int] = field(default_factory=dict)
    leaked_device_blocks: int = 0
    leaked_host_blocks: int = 0
    rss_mib: dict[str, float] = field(default_factory=dict)
    rss_growth: float = 0.0

    @property
    def faults_injected(self) -> int:
        return sum(self.faults.values())

    def problems(self) -> list[str]:
        out = []
        checks = [(self.server_5xx, "5xx responses"), (self.inband_errors, "in-band stream errors"),
                  (sum(self.unexpected.values()), "unexpected outcomes"), (self.hung, "hung scenarios"),
                  (len(self.invariant_failures), "invariant failures"),
                  (self.stalls, "engine stalls (requests queued, nothing running, no steps)"),
                  (self.leaked_device_blocks, "leaked device KV blocks"),
                  (self.leaked_host_blocks, "leaked host KV blocks")]
        out += [f"{n} {what}" for n, what in checks if n]
        if not self.drained:
            out.append(f"server not idle after the run: {self.final}")
        if self.rss_growth > self.config["max_rss_growth"]:
            out.append(f"RSS grew {self.rss_growth:.1%} after warm-up (limit {self.config['max_rss_growth']:.0%})")
        return out

    def markdown(self) -> str:
        rss, peaks, final = self.rss_mib, self.peaks, self.final
        faults = ", ".join(f"{k} {v}" for k, v in sorted(self.faults.items()))
        rows = [
            ("HTTP requests", f"{self.requests} in {self.duration_s:.1f} s "
                              f"({self.requests / max(self.duration_s, 1e-9):.1f}/s), "
                              f"{sum(self.scenarios.values())} scenarios, concurrency {self.config['concurrency']}"),
            ("faults injected", f"{self.faults_injected}: {faults}"),
            ("responses by status", ", ".join(f"{k}: {v}" for k, v in sorted(self.statuses.items()))),
            ("5xx (client-seen / in-band stream errors)", f"{self.server_5xx} / {self.inband_errors}"),
            ("unexpected outcomes", str(sum(self.unexpected.values()))),
            ("hung scenarios (> deadline)", f"{self.hung} (deadline {self.config['deadline_s']:g} s)"),
            ("invariant checks under load (failures)", f"{self.invariant_checks} ({len(self.invariant_failures)})"),
            (f"engine stalls (queued, nothing running, no step for {self.config['stall_after_s']:g} s)",
             str(self.stalls)),
            ("peak KV blocks in use (device / host)",
             f"{peaks.get('device_used_blocks', 0)}/{final.get('device_blocks_total')} / "
             f"{peaks.get('host_used_blocks', 0)}"),
            ("peak paused / swapped requests, open sessions; preemptions",
             f"{peaks.get('paused', 0)} / {peaks.get('swapped', 0)}, {peaks.get('sessions', 0)}; "
             f"{final.get('preemptions_total', 0)}"),
            ("leaked KV blocks after drain (device / host)",
             f"{self.leaked_device_blocks} / {self.leaked_host_blocks}"),
            ("device blocks of retained agent histories after drain (not leaked: released on demand)",
             str(final.get("retained_device_blocks", 0))),
            ("left after drain (requests / paused / sessions)",
             f"{final.get('requests')} / {final.get('paused')} / {final.get('sessions')}"),
            ("RSS MiB (boot / after warm-up / mid / end)",
             " / ".join(f"{rss.get(k, float('nan')):.0f}" for k in ("boot", "warm", "mid", "end"))),
            ("RSS growth after warm-up", f"{self.rss_growth:+.1%} (limit {self.config['max_rss_growth']:.0%})"),
        ]
        lines = ["| figure | value |", "|---|---|"] + [f"| {k} | {v} |" for k, v in rows]
        problems = self.problems()
        lines.append("\n" + ("**PASS**" if not problems else "**FAIL**: " + "; ".join(problems)))
        if self.stall_dumps:
            lines += ["", "First stall, engine queues:"] + [f"    {row}" for row in self.stall_dumps[0]]
        if self.unexpected_samples:
            lines += ["", "Unexpected (samples):"] + [f"- {s}" for s in self.unexpected_samples]
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "faults_injected": self.faults_injected, "problems": self.problems()}


def rss_bytes() -> int:
    try:
        import psutil  # type: ignore[import-not-found]
        return int(psutil.Process().memory_info().rss)
    except ImportError:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def sample_rss() -> float:
    gc.collect()  # garbage waiting for a collection is not a leak
    return rss_bytes() / 2**20


_METRIC = re.compile(r'^segue_http_requests_total\{endpoint="[^"]*",status="(\d+)"\} ([0-9.e+]+)$')


def parse_statuses(text: str) -> dict[str, int]:
    out: dict[str, int] = {}
    for line in text.splitlines():
        m = _METRIC.match(line)
        if m:
            out[m.group(1)] = out.get(m.group(1), 0) + int(float(m.group(2)))
    return out


async def drive(srv: SoakServer, cfg: SoakConfig) -> SoakReport:
    report = SoakReport(config=dataclasses.asdict(cfg))
    tally = Tally()
    rng = random.Random(cfg.seed)
    client = Client(srv.url, cfg.concurrency, tally, rng)
    names = list(MIX)
    weights = [MIX[n][1] for n in names]
    report.rss_mib["boot"] = sample_rss()
    start = time.monotonic()

    def progress() -> float:
        return max(tally.requests / cfg.requests, (time.monotonic() - start) / cfg.seconds)

    async def worker() -> None:
        while tally.requests < cfg.requests and time.monotonic() - start < cfg.seconds:
            name = rng.choices(names, weights)[0]
            tally.scenarios[name] += 1
            try:
                await asyncio.wait_for(MIX[name][0](client), cfg.deadline_s)
            except TimeoutError:
                tally.hung += 1
                tally.wrong(name, f"hung: not done after {cfg.deadline_s:g} s")
            except httpx.HTTPError as e:  # the server closed on us, refused, reset...
                tally.wrong(name, f"transport error {type(e).__name__}: {e}")
            except Exception as e:  # a malformed answer (bad JSON, missing fields)
                tally.wrong(name, f"{type(e).__name__}: {e}")

    async def monitor() -> None:
        last_check = time.monotonic()
        last_step = (-1, time.monotonic())
        stalled = False
        while True:
            await asyncio.sleep(cfg.probe_every_s)
            probe = await server_probe(srv)
            for key in ("device_used_blocks", "host_used_blocks", "paused", "swapped", "sessions"):
                report.peaks[key] = max(report.peaks.get(key, 0), probe[key])
            now = time.monotonic()
            if probe["steps_total"] != last_step[0] or probe["running"] or not probe["waiting"] + probe["swapped"]:
                last_step, stalled = (probe["steps_total"], now), False
            elif now - last_step[1] >= cfg.stall_after_s and not stalled:
                stalled = True  # one count per episode
                report.stalls += 1
                if len(report.stall_dumps) < 3:
                    report.stall_dumps.append(await srv.engine.run_sync(queue_dump))  # type: ignore[union-attr]
            if time.monotonic() - last_check >= cfg.invariant_every_s:
                last_check = time.monotonic()
                await check_invariants(srv, report)
            for key, at in (("warm", cfg.warmup_fraction), ("mid", (1 + cfg.warmup_fraction) / 2)):
                if key not in report.rss_mib and progress() >= at:
                    report.rss_mib[key] = sample_rss()

    async def guarded_monitor() -> None:
        try:
            await monitor()
        except Exception as e:  # the engine died under us: say so instead of dying silently
            report.invariant_failures.append(f"monitor stopped: {type(e).__name__}: {e}")

    watcher = asyncio.create_task(guarded_monitor())
    try:
        await asyncio.gather(*(worker() for _ in range(cfg.concurrency)))
    finally:
        watcher.cancel()
        report.duration_s = time.monotonic() - start
        await client.aclose()
    await finish(srv, cfg, report, tally)
    return report


async def check_invariants(srv: SoakServer, report: SoakReport) -> None:
    assert srv.engine is not None
    report.invariant_checks += 1
    try:
        await srv.engine.run_sync(lambda e: e.check_invariants())
    except Exception as e:  # AssertionError from the checks, EngineDeadError if the loop died
        report.invariant_failures.append(f"{type(e).__name__}: {e}")


async def finish(srv: SoakServer, cfg: SoakConfig, report: SoakReport, tally: Tally) -> None:
    # Abandoned sessions must go by expiry alone: nothing is closed here.
    deadline = time.monotonic() + cfg.session_ttl_s + 30
    probe = await server_probe(srv)
    while not is_idle(probe) and time.monotonic() < deadline:
        await asyncio.sleep(0.2)
        probe = await server_probe(srv)
    report.drained = is_idle(probe)
    await check_invariants(srv, report)
    report.final = probe
    report.leaked_device_blocks = max(probe["held_device_blocks"], probe["device_used_blocks"])
    report.leaked_host_blocks = max(probe["host_table_blocks"], probe["host_used_blocks"])
    report.rss_mib.setdefault("warm", report.rss_mib["boot"])
    report.rss_mib.setdefault("mid", report.rss_mib["warm"])
    report.rss_mib["end"] = sample_rss()
    report.rss_growth = report.rss_mib["end"] / report.rss_mib["warm"] - 1
    async with httpx.AsyncClient(base_url=srv.url) as http:
        report.server_recorded = parse_statuses((await http.get("/metrics")).text)
    report.requests = tally.requests
    report.scenarios = dict(tally.scenarios)
    report.statuses = dict(tally.http)
    report.faults = dict(tally.faults)
    report.outcomes = dict(tally.outcomes)
    report.server_5xx = tally.server_5xx
    report.inband_errors = tally.inband_errors
    report.unexpected = dict(tally.unexpected)
    report.unexpected_samples = list(tally.samples)
    report.hung = tally.hung


def run_soak(cfg: SoakConfig) -> SoakReport:
    """Start a server, soak it, drain it, stop it (blocking; call from a thread without a running loop)."""
    settings = ServerSettings(policy=cfg.policy, concurrency=cfg.concurrency, session_ttl_s=cfg.session_ttl_s,
                              request_timeout_s=cfg.request_timeout_s, kv_cache_tokens=cfg.kv_cache_tokens)
    with SoakServer(settings) as srv:
        return asyncio.run(drive(srv, cfg))
