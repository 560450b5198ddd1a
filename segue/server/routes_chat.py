"""/v1/chat/completions: admission, sessions, and the response (JSON or SSE) of one ChatTurn.

The first output is awaited before the response starts, so errors the engine finds (prompt too
long, bad ids) still get a real status code instead of an error event inside a 200 stream. The
session is updated the moment the turn ends, before the last bytes go out, so a client that
disconnects right after receiving its tool calls still finds its session.
"""
from __future__ import annotations

import time
from typing import AsyncIterator

from fastapi import APIRouter, Request, Response
from starlette.responses import JSONResponse

from segue.server import responses as r
from segue.server.auth import tenant_of
from segue.server.chat_start import ClientGone, start_turn
from segue.server.chat_tools import resolve_tools
from segue.server.context import ServingContext, serving
from segue.server.errors import error_json, to_api_error
from segue.server.limits import Deadline, Slot
from segue.server.protocol import ChatCompletionRequest, ChatMessage, ToolCallIn, random_id
from segue.server.sessions import Session
from segue.server.streaming import SSEResponse, sse, unless_disconnected
from segue.server.templating import normalize
from segue.server.tool_loop import ChatTurn, Delta, TurnEnd
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
        self.turn: ChatTurn | None = None
        self.closed = False

    def on_end(self, end: TurnEnd, content: str) -> str | None:
        """Record the turn in its session (creating one if needed); returns the session id."""
        sessions = self.ctx.sessions
        if end.held is None and self.session is None and not self.body.open_session:
            return None
        if self.session is None:
            self.session = sessions.create(self.tenant)
        # The assistant message exactly as the client got it, which is what it will send back.
        calls = [ToolCallIn.model_validate(c.model_dump()) for c in _tool_calls_out(end.tool_calls)]
        answer = ChatMessage(role="assistant", content=content, tool_calls=calls or None)
        self.session.transcript = [normalize(m) for m in self.body.messages] + [normalize(answer)]
        if end.held is not None:
            sessions.hold(self.session, end.held)
        return self.session.session_id

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.slot.release()
        if self.session is not None:
            self.ctx.sessions.checkin(self.session)
        turn = self.turn
        if turn is not None:
            self.ctx.metrics.observe_latency(ENDPOINT, self.start, turn.first_token_at, time.monotonic(),
                                             turn.completion_tokens, turn.tool_seconds)


@router.post(ENDPOINT, response_model=None)
async def chat_completions(request: Request) -> Response:
    ctx = serving(request)
    start = time.monotonic()
    body = ChatCompletionRequest.model_validate_json(await request.body())
    ctx.check_model(body.model)
    body.check_supported()
    setup = resolve_tools(body.tools, body.tool_choice, ctx.tools)
    tenant = tenant_of(request)
    slot = ctx.limiter.acquire()
    book = TurnBookkeeping(ctx, body, slot, None, tenant, start)
    try:
        if body.session_id is not None:
            book.session = ctx.sessions.checkout(body.session_id, tenant)
        elif setup.client_names or body.open_session:
            ctx.sessions.check_capacity()
        deadline = Deadline(ctx.config.request_timeout_s)
        book.turn = await start_turn(ctx, request, body, setup, book.session, tenant, deadline)
    except ClientGone:
        book.close()
        return Response(status_code=499)  # nginx's "client closed request"; nobody reads it
    except BaseException:
        book.close()
        raise
    rid, created = random_id("chatcmpl"), int(time.time())
    if body.stream:
        headers = {SESSION_HEADER: body.session_id} if body.session_id else None
        return SSEResponse(_stream(ctx, body, book, book.turn, rid, created), headers=headers)
    return await _complete(ctx, request, body, book, book.turn, rid, created)


async def _complete(ctx: ServingContext, request: Request, body: ChatCompletionRequest, book: TurnBookkeeping,
                    turn: ChatTurn, rid: str, created: int) -> Response:
    pieces: list[str] = []
    logprobs: list = []
    result: list = []

    async def collect() -> bool:
        async for ev in turn.events():
            if isinstance(ev, Delta):
                pieces.append(ev.content)
                logprobs.extend(ev.logprobs or [])
            else:
                result.extend([ev, book.on_end(ev, "".join(pieces))])
        return True

    try:
        events_done = await unless_disconnected(request, collect())
    finally:
        book.close()
    if events_done is None or not result:
        return Response(status_code=499)
    end, session_id = result
    content = "".join(pieces)
    message = r.ChatResponseMessage(content=content if content or not end.tool_calls else None,
                                    tool_calls=_tool_calls_out(end.tool_calls) or None)
    lps = r.chat_logprobs(logprobs) if body.logprobs else None
    choice = r.ChatChoice(message=message, finish_reason=end.finish_reason, logprobs=lps)
    resp = r.ChatCompletionResponse(id=rid, created=created, model=ctx.model_name, choices=[choice],
                                    usage=end.usage, session_id=session_id)
    headers = {SESSION_HEADER: session_id} if session_id else None
    return JSONResponse(resp.model_dump(mode="json"), headers=headers)


async def _stream(ctx: ServingContext, body: ChatCompletionRequest, book: TurnBookkeeping, turn: ChatTurn,
                  rid: str, created: int) -> AsyncIterator[str]:
    session_id = body.session_id

    def chunk(delta: r.DeltaMessage, finish: str | None = None, lps: list | None = None,
              usage: r.Usage | None = None) -> r.ChatCompletionChunk:
        logprobs = r.chat_logprobs(lps) if lps else None
        choices = [] if usage is not None else [r.ChatChunkChoice(delta=delta, finish_reason=finish, logprobs=logprobs)]
        return r.ChatCompletionChunk(id=rid, created=created, model=ctx.model_name, choices=choices, usage=usage,
                                     session_id=session_id)

    events = turn.events()
    content: list[str] = []
    try:
        yield sse(chunk(r.DeltaMessage(role="assistant", content="")))
        async for ev in events:
            if isinstance(ev, Delta):
                content.append(ev.content)
                if ev.content or (ev.logprobs and body.logprobs):
                    yield sse(chunk(r.DeltaMessage(content=ev.content), lps=ev.logprobs if body.logprobs else None))
                continue
            session_id = book.on_end(ev, "".join(content))
            if ev.tool_calls:
                calls = _tool_calls_out(ev.tool_calls)
                deltas = [r.ToolCallDelta(index=i, **c.model_dump()) for i, c in enumerate(calls)]
                yield sse(chunk(r.DeltaMessage(tool_calls=deltas)))
            yield sse(chunk(r.DeltaMessage(), finish=ev.finish_reason))
            if body.include_usage:
                yield sse(chunk(r.DeltaMessage(), usage=ev.usage))
    except Exception as e:  # the status line is sent already: report in-band, as OpenAI does
        yield f"data: {error_json(to_api_error(e))}\n\n"
    finally:
        await events.aclose()
        book.close()
    yield "data: [DONE]\n\n"

