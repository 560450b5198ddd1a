"""/v1/chat/completions: admission, sessions, and the response (JSON or SSE) of one ChatTurn.

The first output is awaited before the response starts, so errors the engine finds (prompt too
long, bad ids) still get a real status code instead of an error event inside a 200 stream. The
session is updated the moment the turn ends, before the last bytes go out, so a client that
disconnects right after receiving its tool calls still finds its session.

With `n` > 1 every choice is its own ChatTurn (its own engine request and server-side tool
rounds); their events are merged into one response, each chunk tagged with its choice's index.
Sessions and client-side tools take one choice only (request_bodies.py).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import AsyncIterator

from fastapi import APIRouter, Request, Response
from starlette.responses import JSONResponse

from segue.engine.calls import Abort
from segue.server import responses as r
from segue.server.auth import tenant_of
from segue.server.auto_continue import auto_eligible
from segue.server.chat_start import ClientGone, start_choices
from segue.server.chat_tools import resolve_tools
from segue.server.context import ServingContext, serving
from segue.server.errors import APIError, error_json, to_api_error
from segue.server.limits import Deadline, Slot
from segue.server.openapi import json_body
from segue.server.request_bodies import ChatCompletionRequest, ChatMessage, ToolCallIn, random_id
from segue.server.sessions import Session
from segue.server.streaming import SSEResponse, gather_all, merge_streams, sse, unless_disconnected
from segue.server.templating import normalize
from segue.server.tool_loop import ChatTurn, Delta, TurnEnd
from segue.structured.tool_grammar import no_call_grammar
from segue.tools.spec import ToolCall

router = APIRouter()
SESSION_HEADER = "x-segue-session-id"
ENDPOINT = "/v1/chat/completions"


def _tool_calls_out(calls: list[ToolCall]) -> list[r.ToolCallOut]:
    return [r.ToolCallOut.model_validate(c.to_openai()) for c in calls]


class TurnBookkeeping:
    """What happens when a turn ends, however it ends: session update, slot and session release,
    latency metrics."""

    def __init__(self, ctx: ServingContext, body: ChatCompletionRequest, slot: Slot, session: Session | None,
                 tenant: str | None, start: float) -> None:
        self.ctx, self.body, self.slot, self.session, self.tenant, self.start = ctx, body, slot, session, tenant, start
        # Set by the route: the request's tools, whether any is the client's, and whether a held
        # end of this turn is indexed for a plain client's next request (auto_continue.py).
        self.tools: list | None = None
        self.client_tools = False
        self.auto = False
        # One per choice.
        self.turns: list[ChatTurn] = []
        self.closed = False

    def on_end(self, end: TurnEnd, content: str) -> str | None:
        """Record the turn in its session (creating one if needed); returns the session id."""
        sessions = self.ctx.sessions
        if end.held is None and self.session is None and not self.body.open_session:
            return None
        if self.session is None:
            # A plain turn's hold is the server's business: an implicit session, id never shown.
            auto = self.ctx.auto
            if self.auto and auto is not None and not self.client_tools:
                self.session = auto.open(self.tenant)
            else:
                self.session = sessions.create(self.tenant)
            if self.session is None:
                # No room for another session: the turn ends as a plain one would, not held (the
                # client's next turn starts fresh from the full history).
                if end.held is not None:
                    self.ctx.engine.call(Abort(end.held.request_id))
                return None
        # The assistant message exactly as the client got it, which is what it will send back.
        calls = [ToolCallIn.model_validate(c.model_dump()) for c in _tool_calls_out(end.tool_calls)]
        answer = ChatMessage(role="assistant", content=content, tool_calls=calls or None)
        self.session.transcript = [normalize(m) for m in self.body.messages] + [normalize(answer)]
        if end.held is not None:
            sessions.hold(self.session, end.held)
        if self.auto and self.ctx.auto is not None and self.session.held is not None:
            self.ctx.auto.remember(self.session, self.tools)
        return None if self.session.implicit else self.session.session_id

    async def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        # Turns already ended closed their streams; this aborts any that did not (errors, disconnects).
        for turn in self.turns:
            await turn.aclose()
        self.slot.release()
        if self.session is not None:
            self.ctx.sessions.checkin(self.session)
        if self.turns:
            # One observation per HTTP request; with n choices the stream is paced by the longest.
            firsts = [t.first_token_at for t in self.turns if t.first_token_at is not None]
            self.ctx.metrics.observe_latency(ENDPOINT, self.start, min(firsts, default=None), time.monotonic(),
                                             max(t.completion_tokens for t in self.turns),
                                             max(t.tool_seconds for t in self.turns))


def _talks_about_tools(body: ChatCompletionRequest) -> bool:
    """Tools offered but none may be called, or calls in the history: the answer must be text."""
    return bool(body.tools) or any(m.role == "tool" or m.tool_calls for m in body.messages)


@router.post(ENDPOINT, response_model=None, openapi_extra=json_body(ChatCompletionRequest))
async def chat_completions(request: Request) -> Response:
    ctx = serving(request)
    start = time.monotonic()
    body = ChatCompletionRequest.model_validate_json(await request.body())
    ctx.check_model(body.model)
    body.check_supported()
    # With tools, a response_format constrains the answer that is not a call (the grammar offers both).
    answer = body.output_spec()
    setup = resolve_tools(body.tools, body.tool_choice, ctx.tools, answer)
    setup.answer, setup.answer_param = answer, body.output_param
    if setup.constraint is None and answer is None and _talks_about_tools(body):
        setup.constraint = no_call_grammar()
    if body.num_choices > 1 and setup.client_names:
        raise APIError(400, "n > 1 cannot be combined with client-side tools: a tool call pauses its choice "
                            "in a session, which continues one conversation", param="n")
    tenant = tenant_of(request)
    slot = ctx.limiter.acquire(body.num_choices)
    book = TurnBookkeeping(ctx, body, slot, None, tenant, start)
    try:
        if body.session_id is not None:
            book.session = ctx.sessions.checkout(body.session_id, tenant)
        elif setup.client_names or body.open_session:
            ctx.sessions.check_capacity()
        book.tools, book.client_tools, book.auto = setup.tools, bool(setup.client_names), auto_eligible(ctx, body)
        if book.session is None and book.auto and ctx.auto is not None:
            book.session = ctx.auto.checkout(tenant, setup.tools, [normalize(m) for m in body.messages])
        deadline = Deadline(ctx.config.request_timeout_s)
        book.turns = await start_choices(ctx, request, body, setup, book.session, tenant, deadline)
    except ClientGone:
        await book.close()
        return Response(status_code=499)  # nginx's "client closed request"; nobody reads it
    except BaseException:
        await book.close()
        raise
    rid, created = random_id("chatcmpl"), int(time.time())
    if body.stream:
        headers = {SESSION_HEADER: body.session_id} if body.session_id else None
        return SSEResponse(_stream(ctx, body, book, rid, created), headers=headers)
    return await _complete(ctx, request, body, book, rid, created)


@dataclass
class _Choice:
    """What one choice has produced so far."""
    content: list[str] = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    end: TurnEnd | None = None


def _usage(book: TurnBookkeeping, choices: list[_Choice]) -> r.Usage:
    usages = [c.end.usage for c in choices if c.end is not None]
    return usages[0] if len(usages) == 1 else r.Usage.of_choices(usages, book.turns[0].prompt_tokens)


async def _complete(ctx: ServingContext, request: Request, body: ChatCompletionRequest, book: TurnBookkeeping,
                    rid: str, created: int) -> Response:
    choices = [_Choice() for _ in book.turns]
    session_id: str | None = None

    async def collect(turn: ChatTurn, out: _Choice) -> None:
        nonlocal session_id
        async for ev in turn.events():
            if isinstance(ev, Delta):
                out.content.append(ev.content)
                out.logprobs.extend(ev.logprobs or [])
            else:
                out.end = ev
                session_id = book.on_end(ev, "".join(out.content)) or session_id

    try:
        collecting = [collect(t, c) for t, c in zip(book.turns, choices, strict=True)]
        done = await unless_disconnected(request, gather_all(collecting))
    finally:
        await book.close()
    if done is None or any(c.end is None for c in choices):
        return Response(status_code=499)
    out = []
    for i, c in enumerate(choices):
        end, content = c.end, "".join(c.content)
        assert end is not None
        message = r.ChatResponseMessage(content=content if content or not end.tool_calls else None,
                                        tool_calls=_tool_calls_out(end.tool_calls) or None)
        lps = r.chat_logprobs(c.logprobs) if body.logprobs else None
        out.append(r.ChatChoice(index=i, message=message, finish_reason=end.finish_reason, logprobs=lps,
                                schema_violation=end.schema_violation))
    resp = r.ChatCompletionResponse(id=rid, created=created, model=ctx.model_name, choices=out,
                                    usage=_usage(book, choices), session_id=session_id)
    headers = {SESSION_HEADER: session_id} if session_id else None
    return JSONResponse(resp.model_dump(mode="json"), headers=headers)


async def _stream(ctx: ServingContext, body: ChatCompletionRequest, book: TurnBookkeeping,
                  rid: str, created: int) -> AsyncIterator[str]:
    session_id = body.session_id

    def chunk(index: int, delta: r.DeltaMessage, finish: str | None = None, lps: list | None = None,
              usage: r.Usage | None = None, violation: str | None = None) -> r.ChatCompletionChunk:
        logprobs = r.chat_logprobs(lps) if lps else None
        choices = [] if usage is not None else [r.ChatChunkChoice(index=index, delta=delta, finish_reason=finish,
                                                                  logprobs=logprobs, schema_violation=violation)]
        return r.ChatCompletionChunk(id=rid, created=created, model=ctx.model_name, choices=choices, usage=usage,
                                     session_id=session_id)

    choices = [_Choice() for _ in book.turns]
    events = merge_streams([t.events() for t in book.turns])
    try:
        for i in range(len(choices)):
            yield sse(chunk(i, r.DeltaMessage(role="assistant", content="")))
        async for i, ev in events:
            if isinstance(ev, Delta):
                choices[i].content.append(ev.content)
                if ev.content or (ev.logprobs and body.logprobs):
                    yield sse(chunk(i, r.DeltaMessage(content=ev.content), lps=ev.logprobs if body.logprobs else None))
                continue
            choices[i].end = ev
            session_id = book.on_end(ev, "".join(choices[i].content)) or session_id
            if ev.tool_calls:
                calls = _tool_calls_out(ev.tool_calls)
                deltas = [r.ToolCallDelta(index=k, **c.model_dump()) for k, c in enumerate(calls)]
                yield sse(chunk(i, r.DeltaMessage(tool_calls=deltas)))
            yield sse(chunk(i, r.DeltaMessage(), finish=ev.finish_reason, violation=ev.schema_violation))
        if body.include_usage:
            yield sse(chunk(0, r.DeltaMessage(), usage=_usage(book, choices)))
    except Exception as e:  # the status line is sent already: report in-band, as OpenAI does
        yield f"data: {error_json(to_api_error(e))}\n\n"
    finally:
        await events.aclose()
        await book.close()
    yield "data: [DONE]\n\n"

