"""One chat response, driven to its end: text deltas out, server-side tool rounds in between.

The engine pauses a request whose output completes a tool call. If every call is the operator's,
the tools run here (concurrently, with their timeouts; failures become error results the model
reads), their results are rendered in the template's tool-message form and appended, and the same
engine request continues, so the client sees one response. If any call is the client's, the
request stays paused (detached into a session) and the response ends with finish_reason
"tool_calls". A session's turn that ends normally pauses too (pause_on_stop): the response ends
with "stop" and the session holds the request, its end-of-turn token included, for the human's
reply; so does one cut off by max_tokens (pause_on_length, "length"); the next turn keeps what it
holds of the tokens a fresh request would get. Tool durations are not recorded here:
the engine times each interception itself.

Text inside tool calls is never shown as content: deltas stop short of anything that could still
become a call, and calls leave the stream as `tool_calls` (client-side) or not at all (server-side).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, AsyncIterator

from segue.engine.calls import ExpectResume
from segue.outputs import CompletionOutput, RequestOutput, TokenLogprob
from segue.sampling_params import InvalidRequestError
from segue.server.chat_tools import ToolSetup
from segue.server.errors import APIError
from segue.server.limits import Deadline
from segue.server.responses import Usage
from segue.server.sessions import HeldConversation, HeldRequest, OutputMark
from segue.server.streaming import Prepended, checked
from segue.server.structured_formats import report_violation, schema_violation
from segue.tools.parser import ToolCallParser
from segue.tools.spec import ToolCall

if TYPE_CHECKING:
    from segue.server.context import ServingContext


@dataclass
class Delta:
    content: str = ""
    logprobs: list[TokenLogprob] | None = None


@dataclass
class TurnEnd:
    finish_reason: str
    usage: Usage
    # The client's calls, when finish_reason is "tool_calls".
    tool_calls: list[ToolCall] = field(default_factory=list)
    # The paused request, for the session: on "tool_calls", and on "stop" or "length" in a session.
    held: HeldRequest | None = None
    # Where and why a best-effort structured answer breaks its schema (structured_formats.py).
    schema_violation: str | None = None


@dataclass(frozen=True)
class TurnStream:
    """The engine request a turn drives: its id, its outputs, and how to split their text."""
    request_id: str
    outputs: Prepended
    # Of the format the engine was given (EngineRequest.tool_format). The engine finds and parses
    # the calls (CompletionOutput.tool_calls, read in _on_pause); this one only splits the
    # streamed text, which the engine returns whole, into content and call markup.
    parser: ToolCallParser | None


@dataclass(frozen=True)
class TurnStart:
    """Where a turn starts: its new text, tokens and usage are counted from here."""
    # A continued request's output at its pause (HeldRequest.output); zero for a fresh one.
    output: OutputMark = OutputMark()
    cached_tokens: int = 0
    # Length of a fresh turn's prompt (0 for a continued one), to count a shared prompt once.
    prompt_tokens: int = 0


class ChatTurn:
    """Drives one engine request (new or continued) for one HTTP response."""

    def __init__(self, ctx: "ServingContext", stream: TurnStream, setup: ToolSetup, context: list[dict[str, Any]],
                 deadline: Deadline, start: TurnStart = TurnStart(), *,
                 expected_tool_seconds: float | None = None) -> None:
        self.ctx = ctx
        self.request_id = stream.request_id
        self.outputs = stream.outputs
        self.setup = setup
        self.parser = stream.parser
        self.context = context
        self.deadline = deadline
        self.text_start = start.output.text_len
        self.gen_start = start.output.num_generated
        self.cached_tokens = start.cached_tokens
        self.prompt_tokens = start.prompt_tokens
        self.expected_tool_seconds = expected_tool_seconds
        self.emitted = 0  # characters of the current segment already handled
        self.sent_logprobs = self.gen_start
        self.rounds = 0
        self.tool_seconds = 0.0
        self.first_token_at: float | None = None
        self.completion_tokens = 0

    async def aclose(self) -> None:
        """Abort the request unless it was detached; for turns whose events() never ran."""
        await self.outputs.aclose()

    async def events(self) -> AsyncIterator[Delta | TurnEnd]:
        """Deltas, then exactly one TurnEnd (or an exception). Closing it early aborts the request."""
        try:
            while True:
                try:
                    out = await self.deadline.next(self.outputs)
                except StopAsyncIteration:
                    raise APIError(500, "the engine stream ended without a final output") from None
                c = checked(out)
                self.completion_tokens = c.num_generated_tokens - self.gen_start
                if self.first_token_at is None and self.completion_tokens > 0:
                    self.first_token_at = time.monotonic()
                delta = Delta(self._content(c, out), self._logprobs(c))
                if delta.content or delta.logprobs:
                    yield delta
                if out.finished or _ended_turn(out):
                    end = (self._end(out, c.finish_reason or "stop") if out.finished
                           else await self._hold_turn_end(out, c))
                    # Best effort: an answer that breaks its schema is returned, marked (never a 5xx).
                    problem = schema_violation(self.setup.answer, self._segment(c), c.finish_reason, c.stop_reason)
                    end.schema_violation = report_violation(problem, self.request_id, self.setup.answer_param)
                    yield end
                    return
                if out.paused:
                    paused_end = await self._on_pause(out, c)
                    if paused_end is not None:
                        yield paused_end
                        return
        finally:
            # Aborts the engine request unless it was detached into a session.
            await self.outputs.aclose()

    # ---- text ----------------------------------------------------------------------------
    def _segment(self, c: CompletionOutput) -> str:
        return c.text[self.text_start:]

    def _content(self, c: CompletionOutput, out: RequestOutput) -> str:
        seg = self._segment(c)
        if self.parser is None:
            end = len(seg)
        elif out.paused or out.finished:
            end = len(seg)
        else:
            end = self.parser.safe_prefix_len(seg)
        if end <= self.emitted:
            return ""
        chunk, self.emitted = seg[self.emitted:end], end
        if self.parser is None or out.finished or _ended_turn(out):
            # A call cut off by max_tokens stays visible: the client should see what was written.
            return chunk
        # Only the content: the calls in this chunk reach the client (or the runner) as the engine
        # parsed them, from its output at the pause (_on_pause), so nothing here parses them again.
        return self.parser.content(chunk)

    def _logprobs(self, c: CompletionOutput) -> list[TokenLogprob] | None:
        if c.logprobs is None or len(c.logprobs) <= self.sent_logprobs:
            return None
        new = c.logprobs[self.sent_logprobs:]
        self.sent_logprobs = len(c.logprobs)
        return new

    def _end(self, out: RequestOutput, reason: str, calls: list[ToolCall] | None = None,
             held: HeldRequest | None = None) -> TurnEnd:
        c = out.outputs[0]
        total = len(out.prompt_token_ids) + len(c.token_ids)
        completion = c.num_generated_tokens - self.gen_start
        usage = Usage.of(total - completion, completion, self.cached_tokens)
        return TurnEnd(reason, usage, calls or [], held)

    # ---- pauses --------------------------------------------------------------------------
    async def _hold_turn_end(self, out: RequestOutput, c: CompletionOutput) -> TurnEnd:
        """The turn ended (a stop, or max_tokens) with its request paused: hand it to the session.
        A turn that ended on an end-of-turn token the template continues with goes on by
        appending the next turn's messages; any other (cut off, a stop string the client never
        saw, another stop token) holds tokens the next turn's rendering may not reproduce, so
        that turn re-renders the whole history and replaces what differs (HeldRequest.rerender)."""
        end = self._end(out, c.finish_reason or "stop")
        if not c.token_ids:
            return end
        end_text = ""
        if c.finish_reason != "length" and not isinstance(c.stop_reason, str):
            last = self.ctx.engine.decode([c.token_ids[-1]])
            if self.ctx.renderer.ends_turn_with(last):
                end_text = last
        self.ctx.engine.detach(self.request_id)
        end.held = self._held(out, c, [], end_text=end_text, rerender=not end_text)
        if self.expected_tool_seconds is not None:  # here: how long the human (or client) takes
            await self.ctx.engine.call(ExpectResume(self.request_id, self.expected_tool_seconds))
        return end

    def _held(self, out: RequestOutput, c: CompletionOutput, server_results: list[dict[str, Any]],
              end_text: str = "", rerender: bool = False) -> HeldRequest:
        """The paused request as a session keeps it (the engine request is detached by then)."""
        conversation = HeldConversation(self.context, self._segment(c), self.setup.tools, server_results)
        return HeldRequest(self.request_id, list(out.prompt_token_ids) + list(c.token_ids), conversation,
                           OutputMark(len(c.text), c.num_generated_tokens), self.parser,
                           end_text=end_text, rerender=rerender)

    async def _on_pause(self, out: RequestOutput, c: CompletionOutput) -> TurnEnd | None:
        calls = [self.setup.check_arguments(call) for call in c.tool_calls or []]
        client_calls = [call for call in calls if self.setup.is_client_call(call)]
        server_calls = [call for call in calls if not self.setup.is_client_call(call)]
        if server_calls and not client_calls and self.rounds >= self.ctx.config.max_tool_rounds:
            # Closing the stream (events' finally) aborts the request and frees its KV.
            return self._end(out, "length")
        results: list[dict[str, Any]] = []
        if server_calls:
            self.rounds += 1
            t0 = time.monotonic()
            done = await self.deadline.run(self.ctx.runner.run_all(server_calls))
            self.tool_seconds += time.monotonic() - t0
            for r in done:
                self.ctx.metrics.count_tool_call(r.name, "server", r.is_error)
            results = [r.to_message() for r in done]
        segment = self._segment(c)
        if client_calls:
            for call in client_calls:
                self.ctx.metrics.count_tool_call(call.name, "client", False)
            self.ctx.engine.detach(self.request_id)
            held = self._held(out, c, results)
            if self.expected_tool_seconds is not None:
                await self.ctx.engine.call(ExpectResume(self.request_id, self.expected_tool_seconds))
            return self._end(out, "tool_calls", client_calls, held)
        tokens: list[int] = []
        if results:
            text = await self.ctx.in_thread(self.ctx.renderer.continuation, self.context, segment, results,
                                            self.setup.tools)
            tokens = await self.ctx.in_thread(self.ctx.engine.encode, text)
            self.context = self.context + [{"role": "assistant", "content": segment}] + results
        self.text_start, self.emitted = len(c.text), 0
        try:
            await self.ctx.engine.resume(self.request_id, tokens)
        except InvalidRequestError:  # the results do not fit in the context window
            return self._end(out, "length")
        return None


def _ended_turn(out: RequestOutput) -> bool:
    """Paused at the end of a turn (pause_on_stop: "stop", pause_on_length: "length"): the turn is
    over but the request lives on. A tool call's pause has no finish reason."""
    return out.paused and out.outputs[0].finish_reason in ("stop", "length")
