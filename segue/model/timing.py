"""Timing candidate kernels so that a busy machine cannot decide for a quiet one.

Both measured tables (GEMMs and quantized matmuls in kernel_table.py, attention in
attention_table.py) time their candidates here. A table timed while a package install ran was
3-7x slower per call than a quiet one on a 2-core Xeon, and it was cached for good; so rounds are
repeated until two in a row agree, a candidate replaces the default only by a clear margin, and a
measurement whose rounds never agreed is reported as noisy (its table is used, and measured again
at the first start that finds the machine quiet).
"""
from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

logger = logging.getLogger(__name__)

# Rounds agree when every candidate's median moved by less than this between them.
AGREE = 0.10
MIN_ROUNDS = 2
MAX_ROUNDS = 4
# A candidate replaces the default only when it is this much faster: below it the two are within
# what rounds on a quiet machine differ by, and switching would follow noise.
MARGIN = 0.05
# A round's calls of one candidate take about this long at most: long calls (a 2,048-token
# prefill's attention) need fewer repetitions to agree, and a new model's first start waits for
# every one of them.
ROUND_BUDGET_S = 0.05


@dataclass
class Timing:
    ms: dict[str, float]   # median ms of one call per candidate, over all rounds
    stable: bool           # the last two rounds agreed


def _round(candidates: Mapping[str, Sequence[Callable[[], object]]], reps: int) -> dict[str, list[float]]:
    """Candidates take turns call by call, so a spell of another process's load falls on all of
    them alike instead of on whichever was being timed."""
    times: dict[str, list[float]] = {name: [] for name in candidates}
    width = max(len(calls) for calls in candidates.values())
    for _ in range(reps):
        for i in range(width):
            for name, calls in candidates.items():
                if i < len(calls):
                    t0 = time.perf_counter()
                    calls[i]()
                    times[name].append(time.perf_counter() - t0)
    return times


def _median(xs: list[float]) -> float:
    return sorted(xs)[len(xs) // 2] * 1000


def time_candidates(candidates: Mapping[str, Sequence[Callable[[], object]]], reps: int = 3,
                    min_rounds: int = MIN_ROUNDS, max_rounds: int = MAX_ROUNDS) -> Timing:
    """Median ms of one call of each candidate (each a list of calls cycled through, e.g. over
    weight sets larger than the caches). The median, not the mean: on a small machine another
    process's time slice stalls an OpenMP region now and then (seen: 8 ms on a 0.2 ms call)."""
    slowest = 0.0
    for calls in candidates.values():
        for call in calls:
            t0 = time.perf_counter()
            call()  # warm-up: first touch of buffers, oneDNN's kernel selection
            slowest = max(slowest, time.perf_counter() - t0)
    width = max(len(calls) for calls in candidates.values())
    reps = max(1, min(reps, int(ROUND_BUDGET_S / max(slowest * width, 1e-9))))
    samples: dict[str, list[float]] = {name: [] for name in candidates}
    last: dict[str, float] | None = None
    stable = False
    for rounds in range(1, max_rounds + 1):
        this = _round(candidates, reps)
        for name, ts in this.items():
            samples[name].extend(ts)
        medians = {name: _median(ts) for name, ts in this.items()}
        if last is not None:
            stable = all(abs(medians[n] - last[n]) <= AGREE * min(medians[n], last[n]) for n in medians)
        if stable and rounds >= min_rounds:
            break
        last = medians
    return Timing({name: _median(ts) for name, ts in samples.items()}, stable)


def bucket(ladder: Sequence[int], value: int) -> int:
    """The ladder point (ascending) a value is timed at: the smallest one that holds it, else the largest."""
    return next((point for point in ladder if point >= value), ladder[-1])


def pick(ms: dict[str, float], default: str) -> str:
    """The fastest candidate if it beats `default` by the margin, else `default`."""
    best = min(ms, key=lambda c: ms[c])
    if default not in ms or ms[best] < ms[default] * (1 - MARGIN):
        return best
    return default


def report(what: str, busy: str | None, unstable: list[str], seconds: float) -> bool:
    """Logs a finished measurement; returns whether it was noisy (timed while `busy`, or with
    rounds that never agreed at the points in `unstable`)."""
    noisy = bool(busy or unstable)
    if noisy:
        logger.warning("%s measured on a noisy machine (%s): used, and measured again at the first start that "
                       "finds the machine quiet", what, busy or "rounds disagreed at " + ", ".join(unstable))
    logger.info("%s measured in %.1f s", what, seconds)
    return noisy


def reuse_cached(noisy: bool) -> bool:
    """Whether a cached table can be used: one timed on a quiet machine always; one timed on a busy
    machine only while this one is busy too (measuring again now would be as noisy, and would
    delay every start under load); on a quiet machine it is measured again."""
    return not noisy or machine_busy() is not None


def machine_busy() -> str | None:
    """Why the machine looks busy now (a load average above its CPU count), or None."""
    try:
        load = os.getloadavg()[0]
    except OSError:  # no load average on this platform: nothing to say
        return None
    cpus = os.cpu_count() or 1
    return f"load average {load:.1f} on {cpus} CPUs" if load > cpus else None
