"""Starting a chat turn: continue the session's paused request, or start a new one.

A session's paused request is continued only when the client's history extends what it was shown
(`transcript`), the tools are the same, and the engine still holds exactly the tokens we recorded;
then only the new messages are rendered and appended, so nothing held is recomputed. Otherwise
(history edited, tools changed, request gone) the old request is aborted and a fresh one starts
from the full history; the prefix cache still serves whatever prefix is shared.

The comparison is on messages, not on re-tokenized text: what the model sampled need not be the
tokenizer's canonical encoding of its own text, and the client gets the calls back as OpenAI JSON,
not as the text the model wrote.

A turn in a session (or one that opens a session) pauses at its stop instead of finishing
(pause_on_stop), and so at max_tokens (pause_on_length), so the human's reply continues it like a
tool result does. A request paused at its end-of-turn token already holds that token: the
continuation starts after it. Any other held turn (cut off by max_tokens, ended by a stop string)
may hold tokens that rendering its text does not give: a cut inside a character, a special token
the text skips, the stop string. Its next turn renders the whole history and keeps the longest
common prefix of the held and the rendered tokens; the engine cuts the rest of the context
(LLMEngine.resume's `keep`) and computes the rendered tokens after it, so the request holds exactly
a fresh request's tokens and recomputes only from the first difference.
"""
from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

from fastapi import Request

from segue.engine.calls import Abort, HeldTokens
from segue.engine.engine_request import EngineRequest
from segue.outputs import RequestOutput
from segue.program.registry import scoped_program_id
from segue.sampling_params import InvalidRequestError
from segue.server.auth import cache_salt
from segue.server.auto_continue import auto_eligible
from segue.server.chat_tools import ToolSetup
from segue.server.context import ServingContext
from segue.server.limits import Deadline
from segue.server.request_bodies import ChatCompletionRequest, choice_seed, random_id
from segue.server.sessions import HeldRequest, Session
from segue.server.streaming import prepend, unless_disconnected
from segue.server.templating import normalize
from segue.server.tool_loop import ChatTurn, TurnStart, TurnStream
from segue.tools.call_format import HERMES
from segue.tools.parser import ToolCallParser


class ClientGone(Exception):
    """The client disconnected before the first output; nobody is left to answer."""


async def _first(request: Request, deadline: Deadline, gen: Any) -> RequestOutput:
    first = await unless_disconnected(request, deadline.next(gen))
    if first is None:
        await gen.aclose()
        raise ClientGone()
    return first


def common_prefix_len(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


async def continue_held(ctx: ServingContext, request: Request, body: ChatCompletionRequest, setup: ToolSetup,
                        session: Session, held: HeldRequest, deadline: Deadline) -> ChatTurn | None:
    """The continued turn, or None when the held request cannot be continued (caller aborts it)."""
    n = len(session.transcript)
    history = [normalize(m) for m in body.messages]
    if len(history) <= n or history[:n] != session.transcript or setup.tools != held.conversation.tools:
        return None
    if await ctx.engine.call(HeldTokens(held.request_id)) != held.token_ids:
        return None
    held_conv = held.conversation
    new_messages = held_conv.server_results + ctx.renderer.template_messages(body.messages[n:])
    context = held_conv.context + [{"role": "assistant", "content": held_conv.segment}] + new_messages
    keep: int | None = None
    if held.rerender:
        def render() -> list[int]:
            return ctx.engine.encode(ctx.renderer.render(context, setup.tools))
        fresh = await ctx.in_thread(render)
        keep = common_prefix_len(held.token_ids, fresh)
        suffix = fresh[keep:]
    else:
        text = await ctx.in_thread(ctx.renderer.continuation, held_conv.context, held_conv.segment, new_messages,
                                   setup.tools)
        if not text.startswith(held.end_text):
            return None
        suffix = await ctx.tokenize(text[len(held.end_text):])
    if not suffix:
        return None
    kept = len(held.token_ids) if keep is None else keep
    params = body.to_sampling_params(kept + len(suffix), ctx.max_model_len, ctx.generation_defaults)
    params.structured = setup.constraint or params.structured
    params.pause_on_stop = params.pause_on_length = True
    # An engine refuses to keep less than the request's prompt: the turn then starts fresh.
    gen = ctx.engine.continue_request(held.request_id, suffix, params, keep)
    session.active_request_id = held.request_id
    try:
        first = await _first(request, deadline, gen)
    except InvalidRequestError:  # no longer paused, the new messages overflow the context, or
        await gen.aclose()        # the kept prefix is shorter than the request's prompt
        return None
    return ChatTurn(ctx, TurnStream(held.request_id, prepend(first, gen), held.parser), setup, context, deadline,
                    TurnStart(held.output, cached_tokens=kept), expected_tool_seconds=body.expected_tool_seconds)


async def start_fresh(ctx: ServingContext, request: Request, body: ChatCompletionRequest, setup: ToolSetup,
                      session: Session | None, tenant: str | None, deadline: Deadline, choice: int = 0) -> ChatTurn:
    messages = ctx.renderer.template_messages(body.messages)

    def render() -> list[int]:
        text = ctx.renderer.render(messages, setup.tools)
        return ctx.engine.encode(text)
    prompt_ids = await ctx.in_thread(render)
    params = body.to_sampling_params(len(prompt_ids), ctx.max_model_len, ctx.generation_defaults)
    params.structured = setup.constraint or params.structured
    params.seed = choice_seed(params.seed, choice)
    # Only a session (or, with auto-continuation, a plain client's next request) can continue a
    # paused turn; elsewhere nobody would ever resume it.
    params.pause_on_stop = params.pause_on_length = (session is not None or bool(body.open_session)
                                                     or (choice == 0 and auto_eligible(ctx, body)))
    # The engine pauses at calls in this format and parses them (CompletionOutput.tool_calls); the
    # turn's own parser, of the same format, only keeps call text out of the streamed content.
    tool_format = HERMES if setup.enabled else None
    parser = ToolCallParser.for_format(tool_format) if tool_format is not None else None
    rid = random_id("chatcmpl")
    hints = body.engine_hints(tenant, ctx.prefix_cache_salt(cache_salt(tenant)))
    if session is not None and hints.program_id is None:
        # A session is one conversation: the program of program-level policies when none is named.
        hints = dataclasses.replace(hints, program_id=scoped_program_id(tenant, session.session_id))
    gen = ctx.engine.generate(EngineRequest(prompt_ids, params, rid, hints=hints, tool_format=tool_format))
    if session is not None:
        session.active_request_id = rid
    first = await _first(request, deadline, gen)
    start = TurnStart(cached_tokens=first.num_cached_tokens, prompt_tokens=len(prompt_ids))
    return ChatTurn(ctx, TurnStream(rid, prepend(first, gen), parser), setup, messages, deadline, start,
                    expected_tool_seconds=body.expected_tool_seconds)


async def start_turn(ctx: ServingContext, request: Request, body: ChatCompletionRequest, setup: ToolSetup,
                     session: Session | None, tenant: str | None, deadline: Deadline) -> ChatTurn:
    held = ctx.sessions.take_held(session) if session is not None else None
    if held is not None:
        try:
            turn = await continue_held(ctx, request, body, setup, session, held, deadline)  # type: ignore[arg-type]
        except BaseException:
            ctx.engine.call(Abort(held.request_id))
            raise
        if turn is not None:
            return turn
        ctx.engine.call(Abort(held.request_id))
    return await start_fresh(ctx, request, body, setup, session, tenant, deadline)


async def start_choices(ctx: ServingContext, request: Request, body: ChatCompletionRequest, setup: ToolSetup,
                        session: Session | None, tenant: str | None, deadline: Deadline) -> list[ChatTurn]:
    """The turns of all `n` choices. Choice 0 starts first; once it has a token its prompt's full
    blocks are in the prefix cache, so the other choices start from them instead of prefilling
    the same prompt n times (and an error in the request surfaces once, from choice 0)."""
    first = await start_turn(ctx, request, body, setup, session, tenant, deadline)
    tasks = [asyncio.ensure_future(start_fresh(ctx, request, body, setup, None, tenant, deadline, choice=i))
             for i in range(1, body.num_choices)]
    try:
        await asyncio.gather(*tasks)
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        started = [t.result() for t in tasks if not t.cancelled() and t.exception() is None]
        for turn in [first] + started:
            await turn.aclose()
        raise
    return [first] + [t.result() for t in tasks]
