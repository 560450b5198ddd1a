"""Fit the step-time model the simulator charges, step_ms = a·tokens + b + c·context_tokens +
e·attended_pairs (or a curve f(tokens) in place of a·tokens + b, below), to measured steps, every
coefficient non-negative. The pair term is prefill attention, which grows with a chunk's tokens
times its context (CostModel.fwd_ms_per_attended_pair); points without it (0) leave e at 0.

Why not `np.polyfit(tokens, ms)` over prefill steps: prefill time grows faster than linearly
(attention is quadratic in the chunk), so a straight line through 1..1024-token prefills has a
negative intercept, which clipped to 0 predicts decode steps (few tokens, a weight-bound forward,
per-sequence sampling) at a tenth of their time. Fitting prefill, decode and mixed steps jointly,
with the context term, fixes the form; non-negativity keeps the model physical.

The fit minimises squared *relative* error: step times span ~10 ms decodes to multi-second
prefills, and a workload's timing is mostly many short decode steps, which an unweighted fit
would sacrifice to the few long prefills.

On a CPU the line is not enough: a decode step of 4 sequences costs twice one of 1 (matrix-vector
becomes matrix-matrix and the kernels ramp up to their speed), while prefill grows linearly; a line
through both under-predicts small decode batches by a third. `fit_steps(curve=True)` therefore fits
step_ms = f(tokens) + c·context with f piecewise linear and non-decreasing between knots at the
measured token counts (each segment's rise is a non-negative coefficient, so NNLS keeps f monotone).
"""
from __future__ import annotations

import itertools
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
from scipy.optimize import nnls as _scipy_nnls

from segue.sched.cost_model import interpolate_curve

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
    attended_pairs: int = 0  # (query, key) pairs, summed over the batch (cost_model.attended_pairs)


@dataclass
class StepFit:
    ms_per_token: float
    base_ms: float
    ms_per_context_token: float
    ms_per_seq: float              # 0 unless fitted with per_seq=True (not in CostModel: a diagnostic)
    r2: float                      # on ms, unweighted: how much of the step-time variance the model explains
    mean_abs_rel_error: float      # over all points, |predicted - measured| / measured
    residuals: dict[str, dict[str, float]] = field(default_factory=dict)  # per kind of step
    # With curve=True: [[tokens, ms], ...] at zero context, which replaces a·tokens + b.
    curve: list[list[float]] | None = None
    ms_per_attended_pair: float = 0.0

    def predict_ms(self, tokens: float, context: float, seqs: float = 0.0, pairs: float = 0.0) -> float:
        own = interpolate_curve(self.curve, tokens) if self.curve else self.ms_per_token * tokens + self.base_ms
        return own + self.ms_per_context_token * context + self.ms_per_attended_pair * pairs + self.ms_per_seq * seqs

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def nnls(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """argmin ||x·w - y||² subject to w >= 0 (Lawson-Hanson, scipy)."""
    return _scipy_nnls(x, y)[0]


def curve_knots(tokens: list[int], spacing: float = 1.5) -> list[int]:
    """Knots at the measured token counts, thinned so that neighbours are at least `spacing`
    apart by ratio (129, 132 and 144 add nothing beside 128), always keeping the largest."""
    knots: list[int] = []
    for t in sorted(set(tokens)):
        if not knots or t >= spacing * knots[-1]:
            knots.append(t)
    if knots[-1] != max(tokens):
        knots[-1] = max(tokens)
    return knots


def _ramps(tokens: float, knots: list[int]) -> list[float]:
    """How far `tokens` has climbed each segment between knots, 0..1: f = f(k0) + Σ rise_j·ramp_j."""
    return [min(max((tokens - a) / (b - a), 0.0), 1.0) for a, b in itertools.pairwise(knots)]


def _design(points: list[StepPoint], per_seq: bool, knots: list[int] | None) -> tuple[np.ndarray, np.ndarray]:
    """Columns: a·tokens, b, c·context, e·pairs[, d·seqs]; with knots, f(k0) and one rise per
    segment take the place of a·tokens and b."""
    def own(p: StepPoint) -> list[float]:
        return [1.0] + _ramps(p.batched_tokens, knots) if knots else [p.batched_tokens, 1.0]
    x = np.array([own(p) + [p.context_tokens, p.attended_pairs] + [p.num_seqs] * per_seq for p in points],
                 dtype=float)
    y = np.array([p.step_ms for p in points], dtype=float)
    return x, y


def fit_steps(points: list[StepPoint], per_seq: bool = False, curve: bool = False) -> StepFit:
    """step_ms ≈ a·tokens + b + c·context (+ d·seqs with per_seq), all >= 0, minimising relative
    squared error. per_seq tests whether a sequence costs more than its tokens (sampling, lm_head,
    bookkeeping), which the CostModel cannot express. curve: f(tokens) piecewise linear (see the
    module doc) instead of a·tokens + b; a and b are then the slope of f's last segment and f at its
    first knot."""
    knots = curve_knots([p.batched_tokens for p in points]) if curve and points else None
    ncoef = (len(knots) if knots else 2) + 2 + per_seq
    if len(points) < ncoef:
        raise ValueError(f"need at least {ncoef} step measurements to fit {ncoef} coefficients, got {len(points)}")
    x, y = _design(points, per_seq, knots)
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
    own = 2 if knots is None else len(knots)
    fit = StepFit(ms_per_token=float(w[0]), base_ms=float(w[1]), ms_per_context_token=float(w[own]),
                  ms_per_seq=float(w[own + 2]) if per_seq else 0.0, r2=r2,
                  mean_abs_rel_error=float(np.abs(rel).mean()), residuals=residuals,
                  ms_per_attended_pair=float(w[own + 1]))
    if knots:
        levels = np.cumsum(w[:own])  # f at each knot: f(k0), then one rise per segment
        fit.curve = [[float(k), float(v)] for k, v in zip(knots, levels, strict=True)]
        fit.ms_per_token = float((levels[-1] - levels[-2]) / (knots[-1] - knots[-2])) if own > 1 else 0.0
        fit.base_ms = float(levels[0])
    return fit
