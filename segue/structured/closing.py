"""Finishing a constrained answer within its token budget.

A grammar guarantees that what the model writes is a prefix of a valid answer, not that the answer
ends: a small model sampling at temperature 0.7 can stay inside an unbounded JSON string until
max_tokens cuts it, and the tool call is lost. So near the end of a request's budget the engine
steers. It estimates how many tokens the quickest way out of the current parse state takes (a dry
run on a copy of the matcher) and, once that is about all the budget left, narrows the mask to
tokens that close something (`"`, `}`, `]`) wherever the grammar allows one, and to end-of-sequence
once the answer is complete. Tokens the grammar forces (keys, the tool-call end tag) and values
that must still be written (a required number) are left to the model, under the grammar as always.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import torch

# Dry runs start when this few tokens are left, so requests far from their budget pay nothing.
LOOKAHEAD_TOKENS = 48
# The dry run takes the shortest way; the model, where it still chooses (a number's digits),
# may take longer: steer once need + slack reaches the budget.
_MIN_SLACK = 2

_CLOSING_CHARS = frozenset('"}]')
_BLANK = frozenset(" \n\t")


def _closer_kind(text: bytes) -> str | None:
    """'quote' or 'bracket' (by the first mark) for tokens made only of closing punctuation and
    blanks, with at least one mark; None for every other token."""
    try:
        s = text.decode("utf-8").lstrip(" \n\t")
    except UnicodeDecodeError:
        return None
    if not s or not all(c in _CLOSING_CHARS or c in _BLANK for c in s):
        return None
    return "quote" if s[0] == '"' else "bracket"


def _lowest_token(words: np.ndarray) -> int:
    """Id of the lowest set bit of a uint32 bitmask (which must have one)."""
    idx = int(np.flatnonzero(words)[0])
    w = int(words[idx])
    return idx * 32 + (w & -w).bit_length() - 1


class ClosingSteer:
    """Per tokenizer: the closer-token bitmask and the per-step steering of grammar rows."""

    def __init__(self, ll_tokenizer: Any, vocab_size: int, eos_token_ids: tuple[int, ...]) -> None:
        self.eos_token_ids = eos_token_ids
        words = (vocab_size + 31) // 32
        # Tokens starting with '"' close a string, but outside one they open the next; tokens
        # starting with '}' or ']' close an object or array, but inside a string they are text.
        self._quote = np.zeros(words, dtype=np.uint32)
        self._bracket = np.zeros(words, dtype=np.uint32)
        # Plain letters are allowed inside a free string and nowhere else in JSON structure.
        self._letters = np.zeros(words, dtype=np.uint32)
        for t in range(min(vocab_size, ll_tokenizer.vocab_size)):
            if ll_tokenizer.is_special_token(t):
                continue
            text = ll_tokenizer.decode_bytes([t])
            kind = _closer_kind(text)
            target = self._quote if kind == "quote" else self._bracket if kind == "bracket" else (
                self._letters if len(text) == 1 and text.isalpha() else None)
            if target is not None:
                target[t // 32] |= np.uint32(1 << (t % 32))

    def _choose(self, allowed: np.ndarray) -> np.ndarray | None:
        """The closing tokens among `allowed` (uint32 words) to pick from, or None if none is."""
        n = min(allowed.shape[0], self._quote.shape[0])
        allowed = allowed[:n]
        quote, bracket = allowed & self._quote[:n], allowed & self._bracket[:n]
        in_string = bool((allowed & self._letters[:n]).any())
        for cand in ((quote, bracket) if in_string else (bracket, quote)):
            if cand.any():
                return cand
        return None

    def tokens_to_close(self, matcher: Any, limit: int) -> int:
        """Tokens from the matcher's state to a complete answer along the quickest path (closers
        where allowed, forced tokens, else the lowest allowed id); limit + 1 if more than limit."""
        m = matcher.deep_copy()
        steps = 0
        while steps <= limit:
            if m.is_stopped() or m.is_accepting():
                return steps
            forced = m.compute_ff_tokens()
            if forced:
                tokens = forced
            else:
                allowed = np.frombuffer(m.compute_bitmask(), dtype=np.uint32)
                closing = self._choose(allowed)
                tokens = [_lowest_token(closing if closing is not None else allowed)]
            if not m.consume_tokens(tokens):
                return limit + 1
            steps += len(tokens)
        return limit + 1

    def should_close(self, matcher: Any, remaining: int) -> bool:
        if remaining > LOOKAHEAD_TOKENS:
            return False
        need = self.tokens_to_close(matcher, remaining)
        return need > 0 and need + max(_MIN_SLACK, need // 2) >= remaining

    def narrow(self, matcher: Any, row: torch.Tensor) -> None:
        """Restrict one mask row (int32 words, in place) while closing."""
        if matcher.is_accepting():
            allow_only(row, self.eos_token_ids)
            return
        words = row.numpy().view(np.uint32)  # shares memory with the row
        closing = self._choose(words)
        if closing is not None:
            words[:] = 0
            words[: closing.shape[0]] = closing


def _set_bit(row: torch.Tensor, token: int) -> None:
    k = token % 32
    # int32 two's complement: bit 31 is the sign bit.
    row[token // 32] |= (1 << k) - (1 << 32 if k == 31 else 0)


def allow_only(row: torch.Tensor, tokens: tuple[int, ...]) -> None:
    """Set one mask row (int32 words, in place) to allow `tokens` alone."""
    row.zero_()
    for token in tokens:
        _set_bit(row, token)


def allow_every_end(row: torch.Tensor, eos_token_ids: tuple[int, ...]) -> None:
    """Where llguidance allows its end-of-sequence token (eos_token_ids[0]: the answer may end),
    allow every end-of-turn token the model's generation config names as well."""
    first = eos_token_ids[0]
    if len(eos_token_ids) > 1 and int(row[first // 32]) >> (first % 32) & 1:
        for token in eos_token_ids[1:]:
            _set_bit(row, token)
