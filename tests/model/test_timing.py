"""Timing that settles on a noisy shared machine: candidates interleaved in alternating order, each
pair judged by the median of its paired ratios with an order-statistic interval, the default
kept unless the whole interval clears the margin, and contention read from the process itself."""
from __future__ import annotations

import math
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest

from segue.model import contention, timing


class VirtualClock:
    """perf_counter for fake candidates: a call advances it by its own cost times the load of the
    moment, which bursts now and then (another process's time slice) and drifts slowly."""

    def __init__(self, seed: int, burst: float = 0.25) -> None:
        self.now = 0.0
        self.rng = random.Random(seed)
        self.burst = burst

    def perf_counter(self) -> float:
        return self.now

    def call(self, cost_s: float):
        def run() -> None:
            drift = 1 + 0.3 * math.sin(self.now * 50)
            spike = self.rng.uniform(2, 8) if self.rng.random() < self.burst else 1.0
            self.now += cost_s * drift * spike * self.rng.uniform(0.95, 1.05)
        return run


def timed(monkeypatch: pytest.MonkeyPatch, seed: int, costs: dict[str, float], **kw) -> timing.Timing:
    clock = VirtualClock(seed)
    monkeypatch.setattr(timing.time, "perf_counter", clock.perf_counter)
    # The virtual load is the only one: this machine's own (other tests) must not void the timing.
    monkeypatch.setattr(contention, "disturbed", lambda before, after, threads: None)
    return timing.time_candidates({name: [clock.call(c)] for name, c in costs.items()}, **kw)


def test_median_interval_is_distribution_free_and_refuses_tiny_samples():
    assert timing.median_interval([1.0, 2.0, 3.0, 4.0, 5.0]) == (3.0, 0.0, math.inf)   # 5 < 6 samples
    med, lo, hi = timing.median_interval([float(i) for i in range(1, 21)])
    assert med == 10.5 and (lo, hi) == (6.0, 15.0)   # ranks 6 and 15 of 20 hold the median with 95%
    # Outliers do not move it: a fifth of the samples 100x slower.
    assert timing.median_interval([1.0] * 16 + [100.0] * 4)[:3] == (1.0, 1.0, 1.0)


def test_candidates_alternate_order_each_cycle():
    order: list[str] = []
    timing.time_candidates({n: [lambda n=n: order.append(n)] for n in "abc"}, reps=2, min_rounds=1, max_rounds=1)
    cycles = [tuple(order[i:i + 3]) for i in range(3, len(order), 3)]   # after the warm-up calls
    assert cycles[0] == ("a", "b", "c") and cycles[1] == ("c", "b", "a") and cycles[2] == cycles[0]


def test_a_tie_under_bursty_load_keeps_the_default_every_time(monkeypatch):
    """Two equally fast candidates on a machine where a quarter of all calls are hit 2-8x: the
    medians of separate rounds differ by more than the margin now and then, and a pick by
    medians follows them; the paired interval never clears the margin, so every start agrees."""
    picks = set()
    for seed in range(30):
        t = timed(monkeypatch, seed, {"default": 1e-3, "other": 1e-3}, reps=3)
        picks.add(timing.pick(t.ms, "default", t.ratios))
    assert picks == {"default"}


def test_a_clear_win_is_found_through_the_same_noise(monkeypatch):
    for seed in range(10):
        t = timed(monkeypatch, seed, {"default": 1e-3, "faster": 0.7e-3, "slower": 1.3e-3})
        assert timing.pick(t.ms, "default", t.ratios) == "faster"
        med, lo, hi = timing.ratio_of(t.ratios, "faster", "default")
        assert 0.6 < med < 0.8 and hi < 1 - timing.MARGIN
        assert timing.ratio_of(t.ratios, "default", "faster")[1] == pytest.approx(1 / hi)


def test_a_timing_the_process_spent_waiting_for_its_cpus_decides_nothing(monkeypatch):
    """Contention skews ratios rather than blurring them (a kernel that forks an OpenMP team
    waits for a descheduled worker; one that runs on the caller does not), so a clear win timed
    while waiting is not taken, and the rounds stop as soon as the wait is seen."""
    rounds = []
    clock = VirtualClock(0, burst=0.0)
    monkeypatch.setattr(timing.time, "perf_counter", clock.perf_counter)
    monkeypatch.setattr(contention, "disturbed", lambda before, after, threads: rounds.append(1) or "waited 60%")
    t = timing.time_candidates({"default": [clock.call(1e-3)], "faster": [clock.call(0.5e-3)]})
    assert t.busy == "waited 60%" and t.ratios == {} and not t.stable and len(rounds) == 1
    assert timing.pick(t.ms, "default", t.ratios) == "default"


def test_only_the_pairs_asked_for_are_judged(monkeypatch):
    t = timed(monkeypatch, 0, {"a": 1e-3, "b": 2e-3, "c": 3e-3}, pairs=[("b", "a")])
    assert set(t.ratios) == {"b/a"} and t.stable
    assert not timing.clearly_faster(t.ratios, "c", "a")   # never paired: no decision


def test_a_hand_written_table_without_intervals_decides_by_medians():
    assert timing.pick({"native": 1.0, "sdpa": 0.9}, "native") == "sdpa"
    assert timing.pick({"native": 1.0, "sdpa": 0.97}, "native") == "native"


def test_quota_is_read_from_cgroup_v2_and_v1(tmp_path, monkeypatch):
    v2 = tmp_path / "v2"
    v2.mkdir()
    (v2 / "cpu.max").write_text("150000 100000\n")
    (v2 / "cpu.stat").write_text("usage_usec 10\nthrottled_usec 2500000\n")
    monkeypatch.setattr(contention, "_cgroup_dir", lambda: v2)
    assert contention.cpu_quota() == 1.5 and contention._throttled_s() == 2.5
    (v2 / "cpu.max").write_text("max 100000\n")
    assert contention.cpu_quota() is None
    v1 = tmp_path / "v1"
    (v1 / "cpu").mkdir(parents=True)
    (v1 / "cpu" / "cpu.cfs_quota_us").write_text("200000\n")
    (v1 / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    (v1 / "cpu" / "cpu.stat").write_text("nr_throttled 3\nthrottled_time 4000000000\n")
    monkeypatch.setattr(contention, "_cgroup_dir", lambda: None)
    monkeypatch.setattr(contention, "CGROUP", v1)
    assert contention.cpu_quota() == 2.0 and contention._throttled_s() == 4.0
    assert contention.usable_cpus() <= 2.0


def test_disturbed_reads_run_delay_throttling_and_cpu_share():
    snap = contention.Snapshot
    assert contention.disturbed(snap(0, 0, 0.0, 0.0), snap(1, 2.0, 0.01, 0.0), threads=2) is None
    assert "waited for a CPU" in contention.disturbed(snap(0, 0, 0.0, None), snap(1, 1.0, 0.8, None), 2)
    assert "throttled" in contention.disturbed(snap(0, 0, 0.0, 0.0), snap(1, 1.0, 0.0, 0.5), 2)
    # Without schedstat: the CPU time the threads got against what they could have had.
    assert "got" in contention.disturbed(snap(0, 0, None, None), snap(1, 0.1, None, None), 1)


@pytest.mark.skipif(not Path("/proc/self/task").exists() or not hasattr(os, "sched_setaffinity"),
                    reason="needs Linux's per-thread schedstat and affinity")
def test_a_process_sharing_its_cpu_is_seen_waiting():
    """Real contention, not the host's load average: two spinning processes on this process's
    only CPU make it wait for most of its timing."""
    before_affinity = os.sched_getaffinity(0)
    cpu = min(before_affinity)
    spin = "import os, time\nos.sched_setaffinity(0, {%d})\nt = time.time()\nwhile time.time() - t < 3: pass" % cpu
    os.sched_setaffinity(0, {cpu})
    hogs = [subprocess.Popen([sys.executable, "-c", spin]) for _ in range(2)]
    try:
        time.sleep(0.5)   # the hogs are spinning on this CPU
        before = contention.Snapshot.now()
        t = time.perf_counter()
        while time.perf_counter() - t < 0.5:
            pass
        reason = contention.disturbed(before, contention.Snapshot.now(), threads=1)
    finally:
        for h in hogs:
            h.kill()
            h.wait()
        os.sched_setaffinity(0, before_affinity)
    assert reason is not None and "waited" in reason
