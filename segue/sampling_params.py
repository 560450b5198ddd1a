"""Per-request sampling settings, validated up front so bad input fails before it reaches the engine."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from segue.structured.spec import StructuredSpec


class InvalidRequestError(ValueError):
    """Raised for client mistakes; the server maps it to a 400 response whose `param` names the
    offending field and whose `code` says what is wrong with it (OpenAI's invalid_value for a value
    out of range, unsupported_value for one Segue does not support)."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.param = param
        self.code = code


@dataclass
class SamplingParams:
    max_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 (or -1) disables top-k
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    # Number of most likely alternatives to report per generated token (None: no logprobs).
    logprobs: int | None = None
    include_stop_str_in_output: bool = False
    # End of a turn with more turns to come (a session's chat turn): on EOS, a stop token or a stop
    # string the request pauses (an interception whose end is the next turn) instead of finishing,
    # keeping its context, the stop token included, for the next turn.
    pause_on_stop: bool = False
    # The same for a turn cut off by max_tokens: the context ends with the last generated token (no
    # end-of-turn token; the next turn's text closes the message). The context window still finishes
    # the request: no next turn would fit.
    pause_on_length: bool = False
    # Constrained decoding: the output must match this grammar (JSON schema, tool-call format, ...).
    structured: StructuredSpec | None = None

    @classmethod
    def from_request(cls, max_tokens: int, stop: str | list[str] | None, ignore_eos: bool | None,
                     given: dict[str, Any], defaults: dict[str, Any] | None = None,
                     **exact: Any) -> SamplingParams:
        """A request body's options: `given` (temperature, top_p, top_k, seed; None where the
        client left one out, as many send explicit nulls) over `defaults`, a lone stop string as
        a list, a null ignore_eos as False; `exact` fields passed as they are."""
        optional = {**(defaults or {}), **{k: v for k, v in given.items() if v is not None}}
        stops = [stop] if isinstance(stop, str) else stop or []
        return cls(max_tokens=max_tokens, stop=stops, ignore_eos=bool(ignore_eos), **optional, **exact)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self.validate()

    def validate(self) -> None:
        def bad(param: str, msg: str) -> None:
            raise InvalidRequestError(msg, param=param, code="invalid_value")

        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens < 1:
            bad("max_tokens", f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not isinstance(self.temperature, (int, float)) or not (0.0 <= self.temperature <= 100.0):
            bad("temperature", f"temperature must be a number in [0, 100], got {self.temperature!r}")
        if not isinstance(self.top_p, (int, float)) or not (0.0 < self.top_p <= 1.0):
            bad("top_p", f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            bad("top_k", f"top_k must be an integer >= 0 (or -1 to disable), got {self.top_k!r}")
        if self.seed is not None and not isinstance(self.seed, int):
            bad("seed", f"seed must be an integer, got {self.seed!r}")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or not 0 <= self.logprobs <= 20):
            bad("logprobs", f"logprobs must be an integer in [0, 20], got {self.logprobs!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            bad("stop", "stop must be a list of non-empty strings")
        if len(self.stop) > 16:
            bad("stop", "at most 16 stop strings are allowed")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            bad("stop_token_ids", "stop_token_ids must be non-negative integers")
        if not isinstance(self.pause_on_stop, bool):
            bad("pause_on_stop", f"pause_on_stop must be a boolean, got {self.pause_on_stop!r}")
        if not isinstance(self.pause_on_length, bool):
            bad("pause_on_length", f"pause_on_length must be a boolean, got {self.pause_on_length!r}")
        if self.structured is not None and not isinstance(self.structured, StructuredSpec):
            bad("structured", f"structured must be a StructuredSpec, got {type(self.structured).__name__}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
