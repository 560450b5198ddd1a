"""What the engine keeps beside each scheduler Request: the text side (prompt, incremental
detokenizer, logprobs, tool calls) and the timings reported back to the client."""
from __future__ import annotations

from dataclasses import dataclass, field

from segue.engine.detokenizer import IncrementalDetokenizer
from segue.outputs import RequestMetrics, TokenLogprob
from segue.request import Request
from segue.tools.parser import ToolCallParser


@dataclass
class RequestState:
    request: Request
    prompt: str | None
    detokenizer: IncrementalDetokenizer
    metrics: RequestMetrics
    logprobs: list[TokenLogprob] | None = field(default=None)
    # Text of the generated segments before the last interception (tool results excluded).
    text_before: str = ""
    # Detects tool calls in the output, built from the request's ToolCallFormat; None: never intercept.
    tool_parser: ToolCallParser | None = None
    tool_calls: list | None = None
    # The client's hint of how long its tool calls take (extra_body expected_tool_seconds).
    expected_tool_s: float | None = None
    # Paused at the end of a turn (pause_on_stop, pause_on_length): the turn is over, its output
    # reads as finished with this reason ("stop" or "length").
    turn_end: str | None = None
