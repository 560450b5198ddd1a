"""Message text of about N tokens, for driving a server that takes text rather than token ids.

The words are common English words that BPE vocabularies (GPT-2's, SmolLM2's, Llama's) encode as one
token each after a space, so N words are close to N tokens; a client calibrates the exact ratio and
the chat template's overhead against the server (see client.py) and reports the counts it got.
Words are drawn at random so that distinct requests share no prefix beyond the chat template.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

WORDS: tuple[str, ...] = tuple(
    "the of and to in is was for on that with as by at from it his an were are which this be or has had "
    "not but first one their its new after who they have her she two been other when there all during into "
    "school time may years more most only over city some world would where later up such used many can "
    "state about national out known university united then made".split())


@dataclass
class TokenCalibration:
    """prompt tokens ≈ first_overhead + per_word * words for a one-message chat; each further
    (assistant, user) pair adds about turn_overhead + per_word * words of the user message."""
    per_word: float = 1.0
    first_overhead: float = 0.0
    turn_overhead: float = 0.0

    def words_for(self, tokens: int, overhead: float) -> int:
        return max(1, round((tokens - overhead) / max(self.per_word, 1e-6)))


def filler_text(num_words: int, rng: np.random.Generator) -> str:
    idx = rng.integers(0, len(WORDS), size=max(1, num_words))
    return " ".join(WORDS[int(i)] for i in idx)
