"""/v1/completions: raw prompts (text or token ids), no templates, no tools.

`n` choices are n engine requests for the same prompt ids (request ids `cmpl-...`, `cmpl-...-1`,
...); choice 0 starts first so the others find its prompt in the prefix cache.
"""
from __future__ import annotations

import time
from typing import AsyncIterator

from fastapi import APIRouter, Request, Response
from starlette.responses import JSONResponse

from segue.engine.engine_request import EngineRequest
from segue.outputs import RequestOutput
from segue.server import responses as r
from segue.server.auth import cache_salt, tenant_of
from segue.server.context import ServingContext, serving
from segue.server.errors import error_json, to_api_error
from segue.server.limits import Deadline, Slot
from segue.server.openapi import json_body
from segue.server.request_bodies import CompletionRequest, choice_seed, random_id
from segue.server.streaming import (
    Prepended,
    SSEResponse,
    checked,
    gather_all,
    merge_streams,
    prepend,
    sse,
    unless_disconnected,
)
from segue.server.structured_formats import report_violation, schema_violation
from segue.structured import StructuredSpec

router = APIRouter()
ENDPOINT = "/v1/completions"


def _usage(outs: list[RequestOutput]) -> r.Usage:
    usages = [r.Usage.of(len(o.prompt_token_ids), len(o.outputs[0].token_ids), o.num_cached_tokens) for o in outs]
    return usages[0] if len(usages) == 1 else r.Usage.of_choices(usages, len(outs[0].prompt_token_ids))


def _chunk(ctx: ServingContext, rid: str, created: int, index: int, out: RequestOutput, delta: str,
           lps: list | None, violation: str | None = None) -> r.CompletionChoice:
    offset = len(out.outputs[0].text) - len(delta)
    return r.CompletionChoice(index=index, text=delta,
                              finish_reason=out.outputs[0].finish_reason if out.finished else None,
                              logprobs=r.completion_logprobs(lps, offset) if lps is not None else None,
                              schema_violation=violation)


def _violation(spec: StructuredSpec | None, out: RequestOutput, body: CompletionRequest) -> str | None:
    """A finished choice's schema_violation (structured_formats.py), logged."""
    c = out.outputs[0]
    return report_violation(schema_violation(spec, c.text, c.finish_reason, c.stop_reason), out.request_id,
                            body.output_param)


class _Timing:
    def __init__(self, ctx: ServingContext, slot: Slot, n: int) -> None:
        self.ctx, self.slot = ctx, slot
        self.start = time.monotonic()
        self.first: float | None = None
        self.tokens = [0] * n
        self.done = False

    def saw(self, out: RequestOutput, index: int = 0) -> None:
        self.tokens[index] = out.outputs[0].num_generated_tokens
        if self.first is None and self.tokens[index]:
            self.first = time.monotonic()

    def close(self) -> None:
        if not self.done:
            self.done = True
            self.slot.release()
            # One observation per HTTP request; with n choices the stream is paced by the longest.
            self.ctx.metrics.observe_latency(ENDPOINT, self.start, self.first, time.monotonic(), max(self.tokens))


@router.post(ENDPOINT, response_model=None, openapi_extra=json_body(CompletionRequest))
async def completions(request: Request) -> Response:
    ctx = serving(request)
    body = CompletionRequest.model_validate_json(await request.body())
    ctx.check_model(body.model)
    body.check_supported()
    n = body.num_choices
    timing = _Timing(ctx, ctx.limiter.acquire(n), n)
    streams: list[Prepended] = []
    try:
        deadline = Deadline(ctx.config.request_timeout_s)
        prompt_ids = await ctx.tokenize(body.single_prompt())
        rid, created = random_id("cmpl"), int(time.time())
        tenant = tenant_of(request)
        hints = body.engine_hints(tenant, ctx.prefix_cache_salt(cache_salt(tenant)))

        async def start(index: int) -> Prepended | None:
            params = body.to_sampling_params(len(prompt_ids), ctx.max_model_len, ctx.generation_defaults)
            params.seed = choice_seed(params.seed, index)
            request_id = f"{rid}-{index}" if index else rid
            gen = ctx.engine.generate(EngineRequest(prompt_ids, params, request_id, hints=hints))
            first = await unless_disconnected(request, deadline.next(gen))
            if first is None:
                await gen.aclose()
                return None
            timing.saw(first, index)
            stream = prepend(first, gen)
            streams.append(stream)
            return stream

        # Choice 0 first: after its prefill the prompt's full blocks are cached for the others.
        first = await start(0)
        rest = await gather_all([start(i) for i in range(1, n)]) if first is not None else []
        if first is None or any(s is None for s in rest):
            await _close_all(streams)
            timing.close()
            return Response(status_code=499)  # nginx's "client closed request"; nobody reads it
        outputs = [first] + [s for s in rest if s is not None]
    except BaseException:
        await _close_all(streams)
        timing.close()
        raise
    spec = body.output_spec()
    if body.stream:
        return SSEResponse(_stream(ctx, body, spec, outputs, deadline, timing, rid, created))
    try:
        finals = await unless_disconnected(request, gather_all([_last(o, i, deadline, timing)
                                                                for i, o in enumerate(outputs)]))
    finally:
        await _close_all(outputs)
        timing.close()
    if finals is None:
        return Response(status_code=499)
    choices = []
    for i, final in enumerate(finals):
        c = checked(final)
        choices.append(_chunk(ctx, rid, created, i, final, c.text, c.logprobs, _violation(spec, final, body)))
    response = r.CompletionResponse(id=rid, created=created, model=ctx.model_name, choices=choices,
                                    usage=_usage(finals))
    return JSONResponse(response.model_dump(mode="json"))


async def _close_all(streams: list[Prepended]) -> None:
    for stream in streams:
        await stream.aclose()


async def _last(outputs: Prepended, index: int, deadline: Deadline, timing: _Timing) -> RequestOutput:
    while True:
        out = await deadline.next(outputs)
        timing.saw(out, index)
        if out.finished:
            return out


async def _deadlined(outputs: Prepended, deadline: Deadline) -> AsyncIterator[RequestOutput]:
    while True:
        out = await deadline.next(outputs)
        yield out
        if out.finished:
            return


async def _stream(ctx: ServingContext, body: CompletionRequest, spec: StructuredSpec | None,
                  outputs: list[Prepended], deadline: Deadline, timing: _Timing, rid: str,
                  created: int) -> AsyncIterator[str]:
    """SSE chunks built from text and logprob deltas of the cumulative outputs (logprobs wait for the
    chunk that carries their text), each tagged with its choice's index, then usage, [DONE]. A
    choice whose finished answer breaks its schema says so on its final chunk (schema_violation)."""
    sent_text, sent_lps = [0] * len(outputs), [0] * len(outputs)
    finals: dict[int, RequestOutput] = {}
    merged = merge_streams([_deadlined(o, deadline) for o in outputs])
    try:
        async for i, out in merged:
            timing.saw(out, i)
            c = checked(out)
            delta = c.text[sent_text[i]:]
            if delta or out.finished:
                lps = c.logprobs[sent_lps[i]:] if c.logprobs is not None else None
                sent_text[i], sent_lps[i] = len(c.text), len(c.logprobs or [])
                violation = _violation(spec, out, body) if out.finished else None
                choice = _chunk(ctx, rid, created, i, out, delta, lps, violation)
                yield sse(r.CompletionResponse(id=rid, created=created, model=ctx.model_name, choices=[choice]))
            if out.finished:
                finals[i] = out
        if body.include_usage:
            yield sse(r.CompletionResponse(id=rid, created=created, model=ctx.model_name, choices=[],
                                           usage=_usage([finals[i] for i in sorted(finals)])))
    except Exception as e:  # the status line is sent already: report in-band, as OpenAI does
        yield f"data: {error_json(to_api_error(e))}\n\n"
    finally:
        await merged.aclose()
        await _close_all(outputs)
        timing.close()
    yield "data: [DONE]\n\n"
