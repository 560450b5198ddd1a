"""Whether this process got the CPUs it asked for while it timed kernels.

The host's load average says nothing useful inside a container: it counts every tenant of the
host, and a 2-CPU container on a busy host saw load 9 while its own CPUs sat idle (and the reverse).
What disturbs a timing is this process waiting for a CPU, so that is what is read: the kernel's
per-thread run delay (/proc/self/task/*/schedstat: time runnable but not running) against the CPU
time the process got, and the cgroup's own throttling when a CPU quota caps it (cgroup v2
cpu.max / cpu.stat, v1 cpu.cfs_quota_us / cpu.stat). Where no schedstat exists, the process's CPU
time against the wall time its threads could have used stands in.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

# A timing during which the process waited for a CPU this fraction of the time it wanted one was
# disturbed: on an idle 2-core VM the run delay stays below 2 % of the CPU time.
WAIT_FRACTION = 0.15
# Without schedstat: threads that got less than this share of the wall time each could have run.
CPU_SHARE = 0.5
# Throttled by the cgroup's quota for more than this share of the wall time.
THROTTLED_FRACTION = 0.10

CGROUP = Path("/sys/fs/cgroup")


def _cgroup_dir() -> Path | None:
    """This process's cgroup v2 directory, where the unified hierarchy is mounted at CGROUP."""
    try:
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            if line.startswith("0::"):
                path = CGROUP / line[3:].lstrip("/")
                return path if (path / "cpu.max").exists() else None
    except OSError:
        return None
    return None


def cpu_quota() -> float | None:
    """CPUs the cgroup's quota allows this process (e.g. 2.0), None when unlimited or unknown."""
    v2 = _cgroup_dir()
    try:
        if v2 is not None:
            quota, _, period = (v2 / "cpu.max").read_text().partition(" ")
            return None if quota.strip() == "max" else int(quota) / int(period)
        quota_us = int((CGROUP / "cpu" / "cpu.cfs_quota_us").read_text())
        period_us = int((CGROUP / "cpu" / "cpu.cfs_period_us").read_text())
        return None if quota_us <= 0 else quota_us / period_us
    except (OSError, ValueError):
        return None


def usable_cpus() -> float:
    """The CPUs this process may run on: its affinity, capped by the cgroup's quota."""
    try:
        cpus = float(len(os.sched_getaffinity(0)))
    except AttributeError:  # no affinity call (macOS)
        cpus = float(os.cpu_count() or 1)
    quota = cpu_quota()
    return min(cpus, quota) if quota else cpus


def _throttled_s() -> float | None:
    """Seconds the cgroup has been throttled by its quota so far."""
    v2 = _cgroup_dir()
    path, field, scale = (v2 / "cpu.stat", "throttled_usec", 1e-6) if v2 is not None else \
        (CGROUP / "cpu" / "cpu.stat", "throttled_time", 1e-9)
    try:
        for line in path.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == field:
                return int(value) * scale
    except (OSError, ValueError):
        return None
    return None


def _schedstat_s() -> tuple[float, float] | None:
    """Seconds this process's live threads have run on a CPU, and waited, runnable, for one: both
    in nanoseconds from the same counters (os.times ticks every 10 ms, too coarse for a timing of
    a few milliseconds, where it read 0 CPU time beside a real wait)."""
    ran = waited = 0
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return None
    for tid in tasks:
        try:
            with open(f"/proc/self/task/{tid}/schedstat", encoding="ascii") as f:
                fields = f.read().split()
            ran, waited = ran + int(fields[0]), waited + int(fields[1])
        except FileNotFoundError:  # the thread ended between listing and reading
            continue
        except (OSError, ValueError, IndexError):
            return None
    return ran * 1e-9, waited * 1e-9


@dataclass(frozen=True)
class Snapshot:
    wall: float
    cpu: float
    run_delay: float | None
    throttled: float | None

    @classmethod
    def now(cls) -> Snapshot:
        sched = _schedstat_s()
        if sched is not None:
            return cls(time.perf_counter(), sched[0], sched[1], _throttled_s())
        t = os.times()
        return cls(time.perf_counter(), t.user + t.system, None, _throttled_s())


def disturbed(before: Snapshot, after: Snapshot, threads: int) -> str | None:
    """Why a timing between two snapshots was disturbed, or None when the process had its CPUs."""
    wall = after.wall - before.wall
    cpu = after.cpu - before.cpu
    if wall <= 0:
        return None
    if before.throttled is not None and after.throttled is not None:
        throttled = after.throttled - before.throttled
        if throttled > THROTTLED_FRACTION * wall:
            return f"throttled by the cgroup's CPU quota {throttled / wall:.0%} of the time"
    if before.run_delay is not None and after.run_delay is not None:
        waited = max(0.0, after.run_delay - before.run_delay)
        if waited > WAIT_FRACTION * (waited + cpu):
            return f"waited for a CPU {waited / (waited + cpu):.0%} of the time"
        return None
    share = cpu / (wall * max(1.0, min(float(threads), usable_cpus())))
    return f"got {share:.0%} of its CPUs" if share < CPU_SHARE else None
