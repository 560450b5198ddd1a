"""Fit the step-time model the simulator charges, step_ms = a·tokens + b + c·context_tokens, to
measured steps, with every coefficient non-negative.

Why not `np.polyfit(tokens, ms)` over prefill steps: prefill time grows faster than linearly
(attention is quadratic in the chunk), so a straight line through 1..1024-token prefills has a
negative intercept, which clipped to 0 predicts decode steps (few tokens, a weight-bound forward,
per-sequence sampling) at a tenth of their time. Fitting prefill, decode and mixed steps jointly,
with the context term, fixes the form; non-negativity keeps the model physical.

The fit minimises squared *relative* error: step times span ~10 ms decodes to multi-second
prefills, and a workload's timing is mostly many short decode steps, which an unweighted fit
would sacrifice to the few long prefills.

scipy is not a dependency, so NNLS is solved exactly by enumerating the support: with at most a
handful of columns, the non-negative optimum is the best of the unconstrained least-squares fits
on column subsets whose coefficients all come out non-negative (2^k small solves).
"""
from __future__ import annotations

import itertools
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

# The kinds of step the profiler measures; a mixed step has a prefill chunk and decodes.
KINDS = ("prefill", "decode", "mixed")


@dataclass(frozen=True)
class StepPoint:
    kind: str            # "prefill", "decode" or "mixed"
    batched_tokens: int  # tokens run this step
    context_tokens: int  # KV positions attended over, summed over the batch (as the simulator counts)
    num_seqs: int
    step_ms: float       # median whole-step time (engine.step: schedule, forward, sample, outputs)
    repeats: int = 1
    cpu_ms: float = 0.0  # median process CPU time of the step: wall/cpu shows how loaded the machine was


@dataclass
class StepFit:
    ms_per_token: float
    base_ms: float
    ms_per_context_token: float
    ms_per_seq: float              # 0 unless fitted with per_seq=True (not in CostModel: a diagnostic)
    r2: float                      # on ms, unweighted: how much of the step-time variance the model explains
    mean_abs_rel_error: float      # over all points, |predicted - measured| / measured
    residuals: dict[str, dict[str, float]] = field(default_factory=dict)  # per kind of step

    def predict_ms(self, tokens: float, context: float, seqs: float = 0.0) -> float:
        return self.ms_per_token * tokens + self.base_ms + self.ms_per_context_token * context + self.ms_per_seq * seqs

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def nnls(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """argmin ||x·w - y||² subject to w >= 0, exactly, for a few columns (see the module doc)."""
    n = x.shape[1]
    if n > 8:
        raise ValueError("nnls by support enumeration is for a few columns")
    best_w, best_err = np.zeros(n), float(np.sum(y ** 2))  # the empty support: w = 0
    for k in range(1, n + 1):
        for support in itertools.combinations(range(n), k):
            cols = list(support)
            w_s, *_ = np.linalg.lstsq(x[:, cols], y, rcond=None)
            if np.any(w_s < 0):
                continue  # not feasible; the optimum is among the feasible supports
            w = np.zeros(n)
            w[cols] = w_s
            err = float(np.sum((x @ w - y) ** 2))
            if err < best_err - 1e-12 * max(1.0, best_err):
                best_w, best_err = w, err
    return best_w


def _design(points: list[StepPoint], per_seq: bool) -> tuple[np.ndarray, np.ndarray]:
    x = np.array([[p.batched_tokens, 1.0, p.context_tokens] + [p.num_seqs] * per_seq for p in points], dtype=float)
    y = np.array([p.step_ms for p in points], dtype=float)
    return x, y


def fit_steps(points: list[StepPoint], per_seq: bool = False) -> StepFit:
    """step_ms ≈ a·tokens + b + c·context (+ d·seqs with per_seq), all >= 0, minimising relative
    squared error. per_seq tests whether a sequence costs more than its tokens (sampling, lm_head,
    bookkeeping), which the CostModel cannot express."""
    ncoef = 3 + per_seq
    if len(points) < ncoef:
        raise ValueError(f"need at least {ncoef} step measurements to fit {ncoef} coefficients, got {len(points)}")
    x, y = _design(points, per_seq)
    if np.any(y <= 0):
        raise ValueError("step times must be positive")
    w = nnls(x / y[:, None], np.ones_like(y))  # rows scaled by 1/measured: relative residuals
    pred = x @ w
    ss_res = float(np.sum((y - pred) ** 2))
    ss_tot = float(np.sum((y - y.mean()) ** 2))
    r2 = 1.0 - ss_res / ss_tot if ss_tot > 0 else 1.0
    rel = (pred - y) / y
    residuals: dict[str, dict[str, float]] = {}
    for kind in KINDS:
        idx = [i for i, p in enumerate(points) if p.kind == kind]
        if not idx:
            continue
        residuals[kind] = {"count": len(idx), "measured_ms": float(y[idx].mean()),
                           "predicted_ms": float(pred[idx].mean()),
                           "mean_rel_error": float(rel[idx].mean()),
                           "max_abs_rel_error": float(np.abs(rel[idx]).max())}
    return StepFit(ms_per_token=float(w[0]), base_ms=float(w[1]), ms_per_context_token=float(w[2]),
                   ms_per_seq=float(w[3]) if per_seq else 0.0, r2=r2,
                   mean_abs_rel_error=float(np.abs(rel).mean()), residuals=residuals)
