"""Reading an engine's queues and pools for its callers: the stats snapshot behind /metrics and
the load report a router reads. The engine's side of EngineClient.get_stats, so that nothing
above the engine reads the scheduler."""
from __future__ import annotations

from collections import defaultdict

from segue.engine.stats import EngineStats, LoadReport, PausedKV
from segue.predict import OnlinePredictors
from segue.sched.scheduler import Scheduler
from segue.sched.waste import WasteMeter
from segue.tools.stats import DurationStats


def load_report(s: Scheduler) -> LoadReport:
    """Safe off the engine thread without a lock: each len() is atomic under the GIL, the set of
    them may be one step apart, which is fine for a routing hint."""
    return LoadReport(len(s.running), len(s.waiting), len(s.paused.paused), s.kv.num_used_blocks,
                      s.kv.num_blocks)


def engine_stats(s: Scheduler, waste: WasteMeter, num_steps: int, tool_stats: DurationStats,
                 predictors: OnlinePredictors, step_seconds: tuple[float, float] = (0.0, 0.0)) -> EngineStats:
    """On the engine thread, between steps: one consistent snapshot."""
    kv = s.kv
    paused: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0])  # requests, device, host blocks
    for rid, req in s.paused.paused.items():
        assert req.interception is not None  # paused: intercepted
        row = paused[req.interception.disposition.value]
        row[0] += 1
        row[1] += kv.num_device_blocks_of(rid)
        row[2] += kv.num_host_blocks_of(rid)
    host_used, host_total = kv.num_used_host_blocks, kv.num_host_blocks
    return EngineStats(
        running=len(s.running), waiting=len(s.waiting), paused=len(s.paused.paused), swapped=len(s.paused.swapped),
        device_blocks_used=kv.num_used_blocks, device_blocks_total=kv.num_blocks,
        host_blocks_used=host_used, host_blocks_total=host_total,
        paused_kv={d: PausedKV(*row) for d, row in paused.items()},
        waste=waste.totals.as_dict(), preemptions=s.num_preemptions_total,
        prefix_hit_tokens=s.prefix_hit_tokens, prefix_query_tokens=s.prefix_query_tokens,
        steps=num_steps, step_seconds=step_seconds[0], modelled_step_seconds=step_seconds[1],
        tools=tool_stats.snapshot(), predictors=predictors.snapshot())
