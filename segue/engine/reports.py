"""Reading an engine's queues and pools for its callers: the stats snapshot behind /metrics and
the load report a router reads, both read off the scheduler's state (Scheduler.state). The
engine's side of a GetStats call (engine/calls.py), so that nothing above the engine reads the scheduler."""
from __future__ import annotations

from segue.engine.memory_waste import WasteMeter
from segue.engine.stats import EngineStats, LoadReport, PausedKV
from segue.predict.online import OnlinePredictors
from segue.sched.state import SchedulerState
from segue.tools.stats import DurationStats


def load_report(s: SchedulerState) -> LoadReport:
    """Safe off the engine thread without a lock: each len() is atomic under the GIL, the set of
    them may be one step apart, which is fine for a routing hint."""
    pools = s.kv_counters()
    return LoadReport(len(s.running), len(s.waiting), s.num_paused(), pools.num_used_blocks, pools.num_blocks)


def engine_stats(s: SchedulerState, waste: WasteMeter, num_steps: int, tool_stats: DurationStats,
                 predictors: OnlinePredictors, step_seconds: tuple[float, float] = (0.0, 0.0)) -> EngineStats:
    """On the engine thread, between steps: one consistent snapshot."""
    pools = s.kv_counters()
    return EngineStats(
        running=len(s.running), waiting=len(s.waiting), paused=s.num_paused(), swapped=s.num_swapped(),
        device_blocks_used=pools.num_used_blocks, device_blocks_total=pools.num_blocks,
        host_blocks_used=pools.num_used_host_blocks, host_blocks_total=pools.num_host_blocks,
        paused_kv={d: PausedKV(*row) for d, row in s.paused_kv().items()},
        waste=waste.totals.as_dict(), preemptions=s.num_preemptions_total,
        prefix_hit_tokens=s.prefix_hit_tokens, prefix_query_tokens=s.prefix_query_tokens,
        steps=num_steps, step_seconds=step_seconds[0], modelled_step_seconds=step_seconds[1],
        tools=tool_stats.snapshot(), predictors=predictors.snapshot())
