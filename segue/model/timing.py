"""Timing candidate kernels so that a shared, noisy machine decides as a quiet one would.

Every measured table (GEMMs and quantized matmuls in kernel_table.py, attention in
attention_table.py, elementwise ops in fused_table.py) times its candidates here. On a shared
2-core VM the median of one candidate's calls moved by 3-7x with another process's load, and
tables whose rounds were compared median against median picked a different plan at each of five
starts. So:

- candidates take turns call by call, in alternating order (ABBA), so a spell of load or a
  frequency change falls on all of them alike and no one always runs right after another;
- each cycle of turns gives a paired sample, the ratio of two candidates' times in it; a pair is
  judged by the median of those ratios with a distribution-free (order-statistic) 95% interval,
  which a burst of load widens instead of shifting;
- a candidate replaces the default only when the whole interval of its ratio lies below
  1 - MARGIN: a decision inside the noise keeps the default;
- rounds repeat until every pair asked about is decided or its interval is narrow, up to a cap;
- whether the process waited for its CPUs while timing is read from its own scheduling
  statistics and its cgroup (contention.py), not from the host's load average; a timing that
  waited decides nothing (its points run the default), as contention skews the ratios
  themselves: kernels that fork an OpenMP team suffer it more than those that do not.
"""
from __future__ import annotations

import itertools
import logging
import math
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from segue.model import contention

logger = logging.getLogger(__name__)

# An undecided pair's interval is narrow enough to stop at when hi / lo is below 1 + AGREE.
AGREE = 0.10
MIN_ROUNDS = 2
MAX_ROUNDS = 6
# A candidate replaces the default only when it is this much faster, with 95% confidence: below
# it the two are within what separate quiet measurements differ by.
MARGIN = 0.05
CONFIDENCE = 0.95
# A round's calls of one candidate take about this long at most: long calls (a 2,048-token
# prefill's attention) repeat less, short ones up to SHORT_REPS times `reps`, which costs nothing
# and narrows their intervals.
ROUND_BUDGET_S = 0.05
SHORT_REPS = 4

# "a/b" -> (median, lo, hi) of a's time over b's in the same cycle.
Ratios = dict[str, tuple[float, float, float]]


@dataclass
class Timing:
    ms: dict[str, float]   # median ms of one call per candidate, over all rounds
    stable: bool           # every pair asked about was decided, or its interval is narrow
    ratios: Ratios = field(default_factory=dict)   # empty when `busy`: decide nothing by them
    busy: str | None = None  # why the process did not have its CPUs while timing, if it did not


def median_interval(xs: Sequence[float], confidence: float = CONFIDENCE) -> tuple[float, float, float]:
    """The median of `xs` and an order-statistic interval that holds the true median with
    `confidence` whatever the distribution: [x_(k), x_(n+1-k)] with k the largest rank whose
    binomial tail stays within (1 - confidence) / 2. Fewer than 6 samples cannot reach 95%:
    their interval is (0, inf), which decides nothing."""
    s = sorted(xs)
    n = len(s)
    if n == 0:
        return math.nan, 0.0, math.inf
    med = s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2
    tail, k = 0.0, 0
    for i in range(n):
        p = math.comb(n, i) / 2 ** n
        if tail + p > (1 - confidence) / 2:
            break
        tail, k = tail + p, i + 1
    return (med, s[k - 1], s[n - k]) if k else (med, 0.0, math.inf)


def ratio_of(ratios: Ratios, a: str, b: str) -> tuple[float, float, float] | None:
    """(median, lo, hi) of a's time over b's, from either order it was recorded in."""
    if f"{a}/{b}" in ratios:
        return ratios[f"{a}/{b}"]
    if f"{b}/{a}" in ratios:
        med, lo, hi = ratios[f"{b}/{a}"]
        return 1 / med, (1 / hi if hi else math.inf), (1 / lo if lo else math.inf)
    return None


def clearly_faster(ratios: Ratios, a: str, b: str) -> bool:
    """Whether `a` is faster than `b` by the margin with confidence (False when never paired)."""
    r = ratio_of(ratios, a, b)
    return r is not None and r[2] < 1 - MARGIN


def _decided(r: tuple[float, float, float]) -> bool:
    _, lo, hi = r
    return hi < 1 - MARGIN or lo > 1 / (1 - MARGIN) or (lo > 0 and hi / lo < 1 + AGREE)


def _round(candidates: Mapping[str, Sequence[Callable[[], object]]], reps: int,
           times: dict[str, list[float | None]]) -> None:
    """Appends one cycle of every candidate's calls per (rep, call index) to `times` (None where
    a candidate has fewer calls), in alternating order so that none always follows another."""
    width = max(len(calls) for calls in candidates.values())
    names = list(candidates)
    for _ in range(reps):
        for i in range(width):
            order = names if len(times[names[0]]) % 2 == 0 else names[::-1]
            for name in order:
                calls = candidates[name]
                if i < len(calls):
                    t0 = time.perf_counter()
                    calls[i]()
                    times[name].append(time.perf_counter() - t0)
                else:
                    times[name].append(None)


def _ratios(times: dict[str, list[float | None]], pairs: Iterable[tuple[str, str]]) -> Ratios:
    out: Ratios = {}
    for a, b in pairs:
        paired = [ta / tb for ta, tb in zip(times[a], times[b], strict=True) if ta is not None and tb]
        out[f"{a}/{b}"] = median_interval(paired)
    return out


def _median_ms(ts: list[float | None]) -> float:
    xs = sorted(t for t in ts if t is not None)
    return xs[len(xs) // 2] * 1000


def time_candidates(candidates: Mapping[str, Sequence[Callable[[], object]]], reps: int = 3,
                    min_rounds: int = MIN_ROUNDS, max_rounds: int = MAX_ROUNDS,
                    pairs: Iterable[tuple[str, str]] | None = None) -> Timing:
    """Median ms of one call of each candidate (each a list of calls cycled through, e.g. over
    weight sets larger than the caches), and the paired ratio of each pair in `pairs` (default:
    every pair) with its interval. The median, not the mean: on a small machine another process's
    time slice stalls an OpenMP region now and then (seen: 8 ms on a 0.2 ms call)."""
    wanted = list(pairs) if pairs is not None else list(itertools.combinations(candidates, 2))
    slowest = 0.0
    for calls in candidates.values():
        for call in calls:
            t0 = time.perf_counter()
            call()  # warm-up: first touch of buffers, oneDNN's kernel selection
            slowest = max(slowest, time.perf_counter() - t0)
    width = max(len(calls) for calls in candidates.values())
    reps = max(1, min(reps * SHORT_REPS, int(ROUND_BUDGET_S / max(slowest * width, 1e-9))))
    times: dict[str, list[float | None]] = {name: [] for name in candidates}
    before = contention.Snapshot.now()
    ratios: Ratios = {}
    stable = False
    busy = None
    for rounds in range(1, max_rounds + 1):
        _round(candidates, reps, times)
        if rounds >= min_rounds:
            ratios = _ratios(times, wanted)
            stable = all(_decided(r) for r in ratios.values())
            busy = contention.disturbed(before, contention.Snapshot.now(), torch.get_num_threads())
            # More rounds cannot settle a timing the process spent waiting for its CPUs: under
            # contention a kernel forking an OpenMP team waits for a descheduled worker at each
            # region and one running on the caller alone does not (seen: a native elementwise op
            # 100x slower, losing to torch's), so the ratios themselves are skewed, not noisy.
            if stable or busy:
                break
    if busy:  # nothing to decide by: the table's point runs the default
        logger.debug("timing disturbed (%s): no decision from it", busy)
        ratios, stable = {}, False
    return Timing({name: _median_ms(ts) for name, ts in times.items()}, stable, ratios, busy)


def bucket(ladder: Sequence[int], value: int) -> int:
    """The ladder point (ascending) a value is timed at: the smallest one that holds it, else the largest."""
    return next((point for point in ladder if point >= value), ladder[-1])


def pick(ms: dict[str, float], default: str, ratios: Ratios | None = None) -> str:
    """`default` unless another candidate is faster by the margin: with `ratios` (the paired
    intervals of a timing; empty where it was disturbed), only where the whole interval says so,
    the fastest such one; with None (a table written by hand), by the medians."""
    if ratios is not None:
        faster = [c for c in ms if c != default and clearly_faster(ratios, c, default)]
        return min(faster, key=lambda c: ms[c]) if faster else default
    best = min(ms, key=lambda c: ms[c])
    if default not in ms or ms[best] < ms[default] * (1 - MARGIN):
        return best
    return default


def machine_busy() -> str | None:
    """A reason to expect disturbed timings before any are taken: torch running more threads
    than the cgroup's quota lets run at once (its OpenMP regions then wait on throttled threads)."""
    quota = contention.cpu_quota()
    threads = torch.get_num_threads()
    return f"{threads} threads on a CPU quota of {quota:g}" if quota is not None and threads > quota else None


def first(reasons: Iterable[str | None]) -> str | None:
    """The first reason a table's timings were disturbed, if any was."""
    return next((r for r in reasons if r), None)


def report(what: str, busy: str | None, unstable: list[str], seconds: float) -> bool:
    """Logs a finished measurement; returns whether it was noisy (timed while `busy`, or with
    pairs still undecided at the points in `unstable`). A noisy table is used and kept like any
    other: its undecided points run the default, which measuring again would not make safer."""
    noisy = bool(busy or unstable)
    if noisy:
        logger.warning("%s measured on a noisy machine (%s): where the difference was within the noise "
                       "the default runs; `segue bench kernels --remeasure` measures again", what,
                       busy or "undecided at " + ", ".join(unstable))
    logger.info("%s measured in %.1f s", what, seconds)
    return noisy
