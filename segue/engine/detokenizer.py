"""Incremental detokenization with stop-string handling, for streaming output one token at a time.

Decoding the whole output on every step costs O(n) per token, and decoding each token alone is
wrong: byte-level BPE splits multi-byte characters across tokens, and SentencePiece decoders drop
the leading space of the first token they see. So each step decodes a short window of recent
tokens twice (without and with the new token) and keeps only the new suffix; the window starts a
few tokens back (`prefix_offset`) so the tokenizer sees enough context to render the new token
as it would appear mid-text.
"""
from __future__ import annotations

from typing import Any

from segue.sampling_params import SamplingParams

# Prompt tokens kept as decoding context for the first generated tokens.
_PROMPT_CONTEXT = 5
_REPLACEMENT = "\ufffd"
_SPIECE_SPACE = "\u2581"


class IncrementalDetokenizer:
    """Turns a stream of generated token ids into text for one request.

    The prompt itself is never part of the text: its last few tokens only serve as context, so
    with a SentencePiece tokenizer the first output token keeps its leading space (" Paris"
    after "The capital is"), as the model meant it. Decoding always uses
    clean_up_tokenization_spaces=False because the cleanup rewrites text across token
    boundaries, which would make already-streamed text wrong.
    """

    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: list[int],
        params: SamplingParams,
        skip_special_tokens: bool = True,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._stops = list(params.stop)
        self._include_stop = params.include_stop_str_in_output
        # Context tokens followed by every generated token; only the window from
        # _prefix_offset on is ever decoded, so the list's growth does not cost time.
        self._ids: list[int] = self._prompt_context(prompt_token_ids)
        # Window [prefix_offset, read_offset) decodes to text that was already emitted;
        # tokens from read_offset on have not produced (complete) text yet.
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._num_output = 0
        # Output text made of complete characters only (held-back stop prefixes included).
        self._decoded = ""
        # How much of _decoded may be shown now; grows monotonically.
        self._visible = 0
        self._stop_reason: str | None = None
        self._done = False
        self._token_text_cache: dict[int, str] = {}

    # --- public API -------------------------------------------------------------------------

    def append(self, token_id: int) -> str | None:
        """Feed one generated token; returns the matched stop string if the output now contains one
        (then .text is truncated at the stop string, unless params.include_stop_str_in_output),
        else None. Tokens fed after a stop or after flush() are ignored."""
        if self._done:
            return None
        self._ids.append(token_id)
        self._num_output += 1
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset :])
        # A trailing U+FFFD means the window ends inside a multi-byte character (byte-level BPE
        # or SentencePiece byte fallback): wait for the tokens that complete it. An empty
        # delta (e.g. a skipped special token) also leaves the offsets alone.
        if len(new_text) <= len(prefix_text) or new_text.endswith(_REPLACEMENT):
            return None
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return self._commit(new_text[len(prefix_text) :])

    @property
    def text(self) -> str:
        """Output text so far that is safe to show: never a partial character, never a suffix
        that might turn out to be the start of a stop string. Only ever grows."""
        return self._decoded[: self._visible]

    @property
    def stop_reason(self) -> str | None:
        """The stop string that ended the output, if any."""
        return self._stop_reason

    @property
    def num_output_tokens(self) -> int:
        return self._num_output

    def flush(self) -> str:
        """At finish: the final full text, held-back parts released, stop truncation applied.

        Without a stop match this equals tokenizer.decode(output_ids, skip_special_tokens=...)
        (for SentencePiece, up to the first token's leading space; see the class docstring).
        """
        if not self._done:
            self._done = True
            prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
            new_text = self._decode(self._ids[self._prefix_offset :])
            self._prefix_offset = self._read_offset = len(self._ids)
            # Whatever was waiting for more bytes never got them: emit it as decoded (U+FFFD).
            if len(new_text) > len(prefix_text):
                self._commit(new_text[len(prefix_text) :])
            if self._stop_reason is None:
                self._visible = len(self._decoded)
        return self.text

    def token_text(self, token_id: int) -> str:
        """Text of a single token for logprobs display (special tokens shown, partial bytes as U+FFFD)."""
        cached = self._token_text_cache.get(token_id)
        if cached is not None:
            return cached
        text = self._tokenizer.decode(
            [token_id], skip_special_tokens=False, clean_up_tokenization_spaces=False
        )
        # SentencePiece decoders strip the leading space of the first token; a lone token is
        # always first, so restore the space its piece carries ("▁the" displays as " the").
        piece = self._tokenizer.convert_ids_to_tokens(token_id)
        if isinstance(piece, str) and piece.startswith(_SPIECE_SPACE) and not text.startswith(" "):
            text = " " + text
        self._token_text_cache[token_id] = text
        return text

    # --- internals --------------------------------------------------------------------------

    def _prompt_context(self, prompt_token_ids: list[int]) -> list[int]:
        """The last few prompt tokens, starting on a character boundary.

        A window that starts inside a multi-byte character decodes to U+FFFD there; with
        byte-level BPE that stays local, but SentencePiece's byte fallback turns the whole run
        of byte tokens into U+FFFD, which would swallow the output's first characters. So drop
        leading context tokens until the context no longer starts with U+FFFD.
        """
        tail = list(prompt_token_ids[-_PROMPT_CONTEXT:])
        for start in range(len(tail)):
            if not self._decode(tail[start:]).startswith(_REPLACEMENT):
                return tail[start:]
        return tail

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(
            ids, skip_special_tokens=self._skip_special, clean_up_tokenization_spaces=False
        )

    def _commit(self, delta: str) -> str | None:
        """Append newly decoded characters, then look for a stop string and recompute holdback."""
        old_len = len(self._decoded)
        self._decoded += delta
        if not self._stops:
            self._visible = len(self._decoded)
            return None
        match = self._find_stop(old_len)
        if match is not None:
            start, stop = match
            self._stop_reason = stop
            self._done = True
            end = start + len(stop) if self._include_stop else start
            # Drop whatever the same token produced after the stop string.
            self._decoded = self._decoded[: start + len(stop)]
            self._visible = end
            return stop
        self._visible = len(self._decoded) - self._holdback()
        return None

    def _find_stop(self, old_len: int) -> tuple[int, str] | None:
        """The stop string occurrence completed by the text appended after old_len, if any.

        Earlier occurrences cannot exist (they would have ended the output on an earlier step),
        so only matches ending past old_len are searched. Among several, the one that ends
        first wins (ties: the one starting first), which is what a character-by-character
        stream would see, so the result does not depend on how the text was tokenized.
        """
        best: tuple[int, int, str] | None = None
        for stop in self._stops:
            start = self._decoded.find(stop, max(0, old_len - len(stop) + 1))
            if start == -1:
                continue
            key = (start + len(stop), start, stop)
            if best is None or key[:2] < best[:2]:
                best = key
        return None if best is None else (best[1], best[2])

    def _holdback(self) -> int:
        """Length of the longest suffix of the text that is a proper prefix of some stop string."""
        text = self._decoded
        longest = 0
        for stop in self._stops:
            for k in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:k]):
                    longest = k
                    break
        return longest
