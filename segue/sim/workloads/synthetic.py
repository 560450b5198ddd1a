"""Synthetic requests of the InferCept trace's six kinds, drawn from each kind's own distributions.

Per kind we keep the empirical distributions of the prompt length, the number of interceptions,
the (generated tokens, pause seconds, appended tokens) of an intercepted segment and the generated
tokens of the final segment, and resample each independently. That reproduces every per-kind
marginal (means, tails, the zero-length quirks) for workloads larger than the 397-request trace,
but not correlations inside one request (e.g. a long prompt with long answers); the trace itself
stays the reference (workloads README).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from segue.sim.workloads.trace_request import TraceRequest

KINDS: tuple[str, ...] = ("math", "qa", "ve", "chatbot", "tts", "image")


@dataclass(frozen=True)
class KindStats:
    """Mean shape of one kind's requests: what the generator must reproduce."""
    count: int
    prompt_tokens: float
    interceptions: float
    generated_per_segment: float
    pause_s: float
    appended_tokens: float

    @classmethod
    def of(cls, requests: Sequence[TraceRequest]) -> KindStats:
        inner = [s for r in requests for s in r.segments[:-1]]
        return cls(
            count=len(requests),
            prompt_tokens=float(np.mean([r.prompt_tokens for r in requests])),
            interceptions=float(np.mean([len(r.segments) - 1 for r in requests])),
            generated_per_segment=float(np.mean([g for r in requests for g, _, _ in r.segments])),
            pause_s=float(np.mean([t for _, t, _ in inner])) if inner else 0.0,
            appended_tokens=float(np.mean([a for _, _, a in inner])) if inner else 0.0,
        )


def kind_statistics(requests: Sequence[TraceRequest]) -> dict[str, KindStats]:
    by_kind: dict[str, list[TraceRequest]] = {}
    for r in requests:
        by_kind.setdefault(r.kind, []).append(r)
    return {k: KindStats.of(v) for k, v in by_kind.items()}


@dataclass(frozen=True)
class _KindPools:
    prompts: np.ndarray                      # prompt lengths
    interceptions: np.ndarray                # interceptions per request
    inner: list[tuple[int, float, int]]      # intercepted segments
    final: np.ndarray                        # generated tokens of final segments


class SyntheticInfercept:
    """Draws requests kind by kind from the trace's empirical per-kind pools."""

    def __init__(self, trace: Sequence[TraceRequest]) -> None:
        by_kind: dict[str, list[TraceRequest]] = {}
        for r in trace:
            by_kind.setdefault(r.kind, []).append(r)
        if not by_kind:
            raise ValueError("an empty trace has no statistics to sample from")
        self._pools: dict[str, _KindPools] = {}
        self._weights: dict[str, float] = {}
        for kind, reqs in by_kind.items():
            inner = [(g, float(t), a) for r in reqs for g, t, a in r.segments[:-1] if t is not None]
            self._pools[kind] = _KindPools(
                prompts=np.array([r.prompt_tokens for r in reqs]),
                interceptions=np.array([len(r.segments) - 1 for r in reqs]),
                inner=inner, final=np.array([r.segments[-1][0] for r in reqs]))
            self._weights[kind] = len(reqs)

    @property
    def kinds(self) -> list[str]:
        return list(self._pools)

    def sample_one(self, kind: str, rng: np.random.Generator, key: str) -> TraceRequest:
        pool = self._pools[kind]
        n_int = int(rng.choice(pool.interceptions)) if pool.inner else 0
        picks: list[int] = rng.integers(0, len(pool.inner), size=n_int).tolist() if n_int else []
        segments: list[tuple[int, float | None, int]] = [pool.inner[int(i)] for i in picks]
        segments.append((int(rng.choice(pool.final)), None, 0))
        return TraceRequest(key, kind, int(rng.choice(pool.prompts)), segments)

    def sample(self, n: int, rng: np.random.Generator, kinds: Sequence[str] | None = None,
               mix: dict[str, float] | None = None) -> list[TraceRequest]:
        """n requests; kinds drawn in the trace's proportions unless `mix` gives weights."""
        names = list(kinds) if kinds else self.kinds
        unknown = [k for k in names if k not in self._pools]
        if unknown:
            raise ValueError(f"kinds {unknown} are not in the trace (have {self.kinds})")
        weights = np.array([(mix or self._weights).get(k, 0.0) for k in names], dtype=float)
        if weights.sum() <= 0:
            raise ValueError("the kind mix has no positive weight")
        chosen = rng.choice(len(names), size=n, p=weights / weights.sum())
        return [self.sample_one(names[int(c)], rng, f"syn{i}-{names[int(c)]}") for i, c in enumerate(chosen)]
