"""A workload request as token counts and pauses, independent of any model's vocabulary."""
from __future__ import annotations

import random
from dataclasses import dataclass

from segue.sim.trace import TraceSegment


@dataclass
class TraceRequest:
    key: str
    kind: str
    prompt_tokens: int
    # (tokens generated, interception seconds or None for the last segment, tokens appended)
    segments: list[tuple[int, float | None, int]]

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + sum(g + a for g, _, a in self.segments)

    @property
    def generated_tokens(self) -> int:
        return sum(g for g, _, _ in self.segments)

    @property
    def interception_seconds(self) -> float:
        return sum(t or 0.0 for _, t, _ in self.segments)

    def materialize(self, rng: random.Random, vocab: tuple[int, int]) -> tuple[list[int], list[TraceSegment]]:
        """Random token ids of the right lengths (content does not matter to scheduling)."""
        lo, hi = vocab
        prompt = [rng.randrange(lo, hi) for _ in range(self.prompt_tokens)]
        script = [TraceSegment(max(1, g), t, [rng.randrange(lo, hi) for _ in range(a)] if t is not None else [],
                               kind=self.kind)
                  for g, t, a in self.segments]
        return prompt, script
