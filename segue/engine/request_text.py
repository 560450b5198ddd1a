"""What the engine keeps beside each scheduler Request: the text side (prompt, incremental
detokenizer, logprobs, tool calls) and the timings reported back to the client; and what the
request's output reads at any point."""
from __future__ import annotations

from dataclasses import dataclass, field

from segue.engine.detokenizer import IncrementalDetokenizer
from segue.outputs import CompletionOutput, RequestMetrics, RequestOutput, TokenLogprob
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

    def make_output(self) -> RequestOutput:
        """The output as of now: text so far, tokens, logprobs, finish or pause."""
        req = self.request
        finished = req.is_finished
        done = finished or self.turn_end is not None
        text = self.text_before + (self.detokenizer.flush() if done else self.detokenizer.text)
        reason = req.status.finish_reason or self.turn_end
        completion = CompletionOutput(0, text, list(req.output_token_ids), reason,
                                      req.stop_reason, list(self.logprobs) if self.logprobs is not None else None,
                                      req.num_generated_tokens, self.tool_calls)
        self.metrics.intercepted_time = req.intercepted_seconds
        return RequestOutput(req.request_id, self.prompt, req.prompt_token_ids, [completion], finished,
                             self.metrics, max(req.num_cached_tokens, 0), paused=req.interception is not None)
