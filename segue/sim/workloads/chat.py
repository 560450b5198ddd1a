"""Two synthetic mixes without interceptions by tools: a long-tailed chat mix and a plain throughput mix.

The chat mix's parameters are our choice, not a fit to a dataset: log-normal lengths give the long
right tail seen in public chat logs (most answers short, a few very long), which is what stresses
head-of-line blocking. Conversations have several turns; between turns the user reads and types
(a pause, excluded from normalized latency like any interception) and the next message is appended.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from segue.sim.workloads.trace_request import TraceRequest


@dataclass(frozen=True)
class LogNormal:
    median: float
    sigma: float
    lo: float
    hi: float

    def draw(self, rng: np.random.Generator) -> float:
        return float(np.clip(rng.lognormal(np.log(self.median), self.sigma), self.lo, self.hi))


@dataclass(frozen=True)
class ChatMix:
    # First prompt (system + user message): median 200 tokens, p99 ~2,000.
    prompt_tokens: LogNormal = LogNormal(200, 1.0, 8, 3000)
    # Answer per turn: median 120 tokens; sigma 1.1 puts p99 near 1,500, capped at 2,000.
    output_tokens: LogNormal = LogNormal(120, 1.1, 1, 2000)
    # Follow-up user message and the human's think + type time (capped at 60 s, as the
    # InferCept trace's human-reply model is).
    followup_tokens: LogNormal = LogNormal(40, 0.8, 1, 500)
    think_s: LogNormal = LogNormal(8.0, 0.8, 0.5, 60.0)
    # Turns: 1 + Geometric(p), so P(single turn) = p and the mean is 1/p.
    single_turn_p: float = 0.5
    max_turns: int = 6
    # The whole conversation must fit this context (later turns are dropped to fit).
    max_context: int = 4096

    def sample_one(self, rng: np.random.Generator, key: str) -> TraceRequest:
        turns = int(min(self.max_turns, rng.geometric(self.single_turn_p)))
        prompt = int(self.prompt_tokens.draw(rng))
        used = prompt
        segments: list[tuple[int, float | None, int]] = []
        for t in range(turns):
            gen = int(self.output_tokens.draw(rng))
            if used + gen >= self.max_context:
                gen = max(1, self.max_context - used - 1)
            used += gen
            follow = int(self.followup_tokens.draw(rng))
            if t == turns - 1 or used + follow + 2 >= self.max_context:
                segments.append((gen, None, 0))
                break
            segments.append((gen, self.think_s.draw(rng), follow))
            used += follow
        return TraceRequest(key, "chat", prompt, segments)

    def sample(self, n: int, rng: np.random.Generator) -> list[TraceRequest]:
        return [self.sample_one(rng, f"chat{i}") for i in range(n)]


@dataclass(frozen=True)
class ThroughputMix:
    """Every request the same: one prompt, one answer, no pauses (as `segue bench throughput`)."""
    prompt_tokens: int = 256
    output_tokens: int = 128

    def sample(self, n: int, rng: np.random.Generator | None = None) -> list[TraceRequest]:
        return [TraceRequest(f"tp{i}", "throughput", self.prompt_tokens, [(self.output_tokens, None, 0)])
                for i in range(n)]
