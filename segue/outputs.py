"""What the engine hands back to callers after each step (vLLM's RequestOutput vocabulary)."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TokenLogprob:
    token_id: int
    token: str
    logprob: float
    # The most likely alternatives at this position: (token_id, token text, logprob).
    top: list[tuple[int, str, float]] = field(default_factory=list)


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None while running
    stop_reason: str | int | None = None  # the stop string or token that ended it
    logprobs: list[TokenLogprob] | None = None
    # Tokens the model generated; token_ids also holds tokens appended by interceptions.
    num_generated_tokens: int = 0
    # Tool calls the request is paused on (set while paused; see RequestOutput.paused).
    tool_calls: list | None = None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0
    # Seconds spent inside interceptions (tool calls, human turns), excluded from normalized latency.
    intercepted_time: float = 0.0


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    num_cached_tokens: int = 0
    # True while the request waits in an interception (a tool call, a client turn).
    paused: bool = False
