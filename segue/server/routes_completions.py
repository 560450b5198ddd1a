"""/v1/completions: raw prompts (text or token ids), no templates, no tools."""
from __future__ import annotations

import time
from typing import AsyncGenerator, AsyncIterator

from fastapi import APIRouter, Request, Response
from starlette.responses import JSONResponse

from segue.outputs import RequestOutput
from segue.server import responses as r
from segue.server.auth import cache_salt, tenant_of
from segue.server.context import ServingContext, serving
from segue.server.errors import error_json, to_api_error
from segue.server.limits import Deadline, Slot
from segue.server.protocol import CompletionRequest, random_id
from segue.server.streaming import SSEResponse, checked, prepend, sse, unless_disconnected

router = APIRouter()
ENDPOINT = "/v1/completions"


def _usage(out: RequestOutput) -> r.Usage:
    return r.Usage.of(len(out.prompt_token_ids), len(out.outputs[0].token_ids), out.num_cached_tokens)


def _chunk(ctx: ServingContext, rid: str, created: int, out: RequestOutput, delta: str,
           lps: list | None) -> r.CompletionResponse:
    offset = len(out.outputs[0].text) - len(delta)
    choice = r.CompletionChoice(text=delta, finish_reason=out.outputs[0].finish_reason if out.finished else None,
                                logprobs=r.completion_logprobs(lps, offset) if lps is not None else None)
    return r.CompletionResponse(id=rid, created=created, model=ctx.model_name, choices=[choice])


class _Timing:
    def __init__(self, ctx: ServingContext, slot: Slot) -> None:
        self.ctx, self.slot = ctx, slot
        self.start = time.monotonic()
        self.first: float | None = None
        self.tokens = 0
        self.done = False

    def saw(self, out: RequestOutput) -> None:
        self.tokens = out.outputs[0].num_generated_tokens
        if self.first is None and self.tokens:
            self.first = time.monotonic()

    def close(self) -> None:
        if not self.done:
            self.done = True
            self.slot.release()
            self.ctx.metrics.observe_latency(ENDPOINT, self.start, self.first, time.monotonic(), self.tokens)


@router.post(ENDPOINT, response_model=None)
async def completions(request: Request) -> Response:
    ctx = serving(request)
    body = CompletionRequest.model_validate_json(await request.body())
    ctx.check_model(body.model)
    body.check_supported()
    timing = _Timing(ctx, ctx.limiter.acquire())
    try:
        deadline = Deadline(ctx.config.request_timeout_s)
        prompt_ids = await ctx.tokenize(body.single_prompt())
        params = body.to_sampling_params(len(prompt_ids), ctx.max_model_len)
        rid, created = random_id("cmpl"), int(time.time())
        hints = {**body.engine_hints(), **ctx.generate_hints(cache_salt(tenant_of(request)))}
        gen = ctx.engine.generate(prompt_ids, params, request_id=rid, **hints)
        first = await unless_disconnected(request, deadline.next(gen))
        if first is None:
            await gen.aclose()
            timing.close()
            return Response(status_code=499)  # nginx's "client closed request"; nobody reads it
        timing.saw(first)
        outputs = prepend(first, gen)
    except BaseException:
        timing.close()
        raise
    if body.stream:
        return SSEResponse(_stream(ctx, body, outputs, deadline, timing, rid, created))
    try:
        final = await unless_disconnected(request, _last(outputs, deadline, timing))
    finally:
        await outputs.aclose()
        timing.close()
    if final is None:
        return Response(status_code=499)
    c = checked(final)
    response = _chunk(ctx, rid, created, final, c.text, c.logprobs)
    response.usage = _usage(final)
    return JSONResponse(response.model_dump(mode="json"))


async def _last(outputs: AsyncGenerator[RequestOutput, None], deadline: Deadline, timing: _Timing) -> RequestOutput:
    while True:
        out = await deadline.next(outputs)
        timing.saw(out)
        if out.finished:
            return out


async def _stream(ctx: ServingContext, body: CompletionRequest, outputs: AsyncGenerator[RequestOutput, None],
                  deadline: Deadline, timing: _Timing, rid: str, created: int) -> AsyncIterator[str]:
    """SSE chunks built from text and logprob deltas of the cumulative outputs (logprobs wait for the
    chunk that carries their text), then usage, [DONE]."""
    sent_text, sent_lps = 0, 0
    try:
        while True:
            out = await deadline.next(outputs)
            timing.saw(out)
            c = checked(out)
            delta = c.text[sent_text:]
            if delta or out.finished:
                lps = c.logprobs[sent_lps:] if c.logprobs is not None else None
                sent_text, sent_lps = len(c.text), len(c.logprobs or [])
                yield sse(_chunk(ctx, rid, created, out, delta, lps))
            if out.finished:
                break
        if body.include_usage:
            yield sse(r.CompletionResponse(id=rid, created=created, model=ctx.model_name, choices=[],
                                           usage=_usage(out)))
    except Exception as e:  # the status line is sent already: report in-band, as OpenAI does
        yield f"data: {error_json(to_api_error(e))}\n\n"
    finally:
        await outputs.aclose()
        timing.close()
    yield "data: [DONE]\n\n"
