"""The FastAPI application: /health, /v1/models, /v1/completions, /v1/chat/completions.

Routes validate, tokenize (in a worker thread: tokenizers and chat templates are slow enough to
stall every other stream), then drive AsyncLLMEngine.generate. The first output is awaited before
the response starts, so errors the engine finds (prompt too long, bad token ids) still get a real
status code instead of an error event inside a 200 stream. Bodies are parsed as JSON whatever
their content type, because `curl -d` labels JSON as form data. A client that goes away aborts its
request, streaming or not, so its KV blocks return to the pool at once.
"""
from __future__ import annotations

import asyncio
import contextlib
import hmac
import time
from dataclasses import dataclass
from typing import Any, AsyncGenerator, AsyncIterator, Awaitable, Callable, TypeVar

import anyio
from fastapi import APIRouter, FastAPI, Request, Response
from pydantic import BaseModel
from starlette.responses import JSONResponse, StreamingResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from segue.async_engine import AsyncLLMEngine
from segue.outputs import CompletionOutput, RequestOutput
from segue.server import protocol as p
from segue.server.errors import APIError, error_json, error_response, install_error_handlers, to_api_error

T = TypeVar("T")
# How often a non-streaming request checks whether its client is still connected.
DISCONNECT_POLL_S = 0.25
# Paths served without an API key (load balancer probes carry no credentials).
OPEN_PATHS = frozenset({"/health"})


@dataclass
class ServingContext:
    engine: AsyncLLMEngine
    model_name: str
    max_model_len: int
    created: int

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise APIError(404, f"the model {model!r} does not exist; this server serves {self.model_name!r}",
                           param="model", code="model_not_found")

    async def in_thread(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(None, fn, *args)

    async def tokenize(self, prompt: str | list[int]) -> list[int]:
        return list(prompt) if isinstance(prompt, list) else await self.in_thread(self.engine.engine.encode, prompt)

    async def tokenize_chat(self, messages: list[dict[str, Any]]) -> list[int]:
        def work() -> list[int]:
            import jinja2

            try:
                text = self.engine.engine.apply_chat_template(messages)
            except jinja2.TemplateError as e:  # templates raise_exception() on e.g. bad role order
                raise APIError(400, f"the chat template rejected the messages: {e}", param="messages") from e
            return self.engine.engine.encode(text)
        return await self.in_thread(work)


class APIKeyMiddleware:
    """Bearer-token check in front of everything but OPEN_PATHS. Plain ASGI rather than
    BaseHTTPMiddleware, which would buffer streams and hide client disconnects."""

    def __init__(self, app: ASGIApp, api_keys: list[str]) -> None:
        self.app = app
        self.keys = [k.encode() for k in api_keys]

    def _authorized(self, scope: Scope) -> bool:
        for name, value in scope.get("headers", []):
            if name == b"authorization":
                scheme, _, token = value.partition(b" ")
                # compare_digest on every key: timing must not reveal which prefix matched.
                hits = [hmac.compare_digest(token.strip(), k) for k in self.keys]
                return scheme.lower() == b"bearer" and any(hits)
        return False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS or self._authorized(scope):
            await self.app(scope, receive, send)
            return
        err = APIError(401, "invalid or missing API key (send Authorization: Bearer <key>)", code="invalid_api_key")
        await error_response(err)(scope, receive, send)


class SSEResponse(StreamingResponse):
    media_type = "text/event-stream"

    async def stream_response(self, send: Send) -> None:
        try:
            await super().stream_response(send)
        finally:
            # On disconnect Starlette cancels this task and drops the iterator, which may be parked
            # at a yield; close it now (its finally aborts the request) instead of whenever GC runs.
            with anyio.CancelScope(shield=True):
                close = getattr(self.body_iterator, "aclose", None)
                if close is not None:
                    await close()


def _sse(obj: BaseModel) -> str:
    return f"data: {obj.model_dump_json()}\n\n"


def _checked(out: RequestOutput) -> CompletionOutput:
    c = out.outputs[0]
    if c.finish_reason == "abort":
        raise APIError(503, "the request was aborted by the server (shutting down or engine failure)",
                       code="request_aborted")
    return c


def _usage(out: RequestOutput) -> p.Usage:
    return p.Usage.of(len(out.prompt_token_ids), len(out.outputs[0].token_ids), out.num_cached_tokens)


async def _unless_disconnected(request: Request, aw: Awaitable[T]) -> T | None:
    """Await `aw`, cancelling it (which aborts the engine request) if the client disconnects."""
    task = asyncio.ensure_future(aw)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if done:
                return task.result()
            if await request.is_disconnected():
                return None
    finally:
        if not task.done():
            task.cancel()
            # Let the cancellation land (the generator aborts the request) before anyone calls
            # aclose() on the generator, which raises if the task is still inside it.
            await asyncio.wait({task})


async def _last(first: RequestOutput, gen: AsyncGenerator[RequestOutput, None]) -> RequestOutput:
    last = first
    async for out in gen:
        last = out
    return last


async def _start(ctx: ServingContext, request: Request, prompt_ids: list[int], params: Any,
                 request_id: str) -> tuple[RequestOutput | None, AsyncGenerator[RequestOutput, None]]:
    gen: Any = ctx.engine.generate(prompt_ids, params, request_id=request_id)
    first = await _unless_disconnected(request, gen.__anext__())
    return first, gen


async def _stream(first: RequestOutput, gen: AsyncGenerator[RequestOutput, None], include_usage: bool,
                  make_chunks: Callable[[RequestOutput, str, list], list[BaseModel]],
                  usage_chunk: Callable[[p.Usage], BaseModel], prologue: list[BaseModel]) -> AsyncIterator[str]:
    """SSE events for one request: prologue, then chunks built from text and logprob deltas of the
    cumulative outputs (logprobs wait for the chunk that carries their text), then usage, [DONE]."""
    sent_text, sent_lps = 0, 0
    outputs = _prepend(first, gen)
    try:
        for chunk in prologue:
            yield _sse(chunk)
        out = first
        async for out in outputs:
            c = _checked(out)
            delta = c.text[sent_text:]
            if not delta and not out.finished:
                continue
            lps = c.logprobs[sent_lps:] if c.logprobs is not None else None
            sent_text, sent_lps = len(c.text), len(c.logprobs or [])
            for chunk in make_chunks(out, delta, lps):
                yield _sse(chunk)
        if include_usage:
            yield _sse(usage_chunk(_usage(out)))
    except Exception as e:  # the status line is sent already: report in-band, as OpenAI does
        yield f"data: {error_json(to_api_error(e))}\n\n"
    finally:
        await outputs.aclose()
        await gen.aclose()
    yield "data: [DONE]\n\n"


async def _prepend(first: RequestOutput,
                   gen: AsyncGenerator[RequestOutput, None]) -> AsyncGenerator[RequestOutput, None]:
    yield first
    if not first.finished:
        async for out in gen:
            yield out


router = APIRouter()


def _ctx(request: Request) -> ServingContext:
    return request.app.state.serving


@router.get("/health")
async def health(request: Request) -> Response:
    # Load balancers need a real answer: 503 once the engine loop is gone or shutting down.
    if not _ctx(request).engine.is_running:
        return JSONResponse({"status": "unavailable"}, status_code=503)
    return JSONResponse({"status": "ok"})


@router.get("/v1/models")
async def list_models(request: Request) -> p.ModelList:
    ctx = _ctx(request)
    return p.ModelList(data=[p.ModelCard(id=ctx.model_name, created=ctx.created, max_model_len=ctx.max_model_len)])


@router.get("/v1/models/{model_id:path}")
async def get_model(model_id: str, request: Request) -> p.ModelCard:
    ctx = _ctx(request)
    ctx.check_model(model_id)
    return p.ModelCard(id=ctx.model_name, created=ctx.created, max_model_len=ctx.max_model_len)


@router.post("/v1/completions", response_model=None)
async def completions(request: Request) -> Response | p.CompletionResponse:
    ctx = _ctx(request)
    body = p.CompletionRequest.model_validate_json(await request.body())
    ctx.check_model(body.model)
    body.check_supported()
    prompt_ids = await ctx.tokenize(body.single_prompt())
    params = body.to_sampling_params(len(prompt_ids), ctx.max_model_len)
    rid, created = p.random_id("cmpl"), int(time.time())
    first, gen = await _start(ctx, request, prompt_ids, params, rid)
    if first is None:
        return Response(status_code=499)  # nginx's "client closed request"; nobody reads it

    def chunks(out: RequestOutput, delta: str, lps: list | None) -> list[BaseModel]:
        offset = len(out.outputs[0].text) - len(delta)
        choice = p.CompletionChoice(text=delta, finish_reason=out.outputs[0].finish_reason if out.finished else None,
                                    logprobs=p.completion_logprobs(lps, offset) if lps is not None else None)
        return [p.CompletionResponse(id=rid, created=created, model=ctx.model_name, choices=[choice])]

    if body.stream:
        return SSEResponse(_stream(first, gen, body.include_usage, chunks, lambda u: p.CompletionResponse(
            id=rid, created=created, model=ctx.model_name, choices=[], usage=u), []))
    try:
        final = await _unless_disconnected(request, _last(first, gen))
    finally:
        await gen.aclose()
    if final is None:
        return Response(status_code=499)
    c = _checked(final)
    response = chunks(final, c.text, c.logprobs)[0]
    assert isinstance(response, p.CompletionResponse)
    response.usage = _usage(final)
    return response


@router.post("/v1/chat/completions", response_model=None)
async def chat_completions(request: Request) -> Response | p.ChatCompletionResponse:
    ctx = _ctx(request)
    body = p.ChatCompletionRequest.model_validate_json(await request.body())
    ctx.check_model(body.model)
    body.check_supported()
    prompt_ids = await ctx.tokenize_chat([m.to_template_dict() for m in body.messages])
    params = body.to_sampling_params(len(prompt_ids), ctx.max_model_len)
    rid, created = p.random_id("chatcmpl"), int(time.time())
    first, gen = await _start(ctx, request, prompt_ids, params, rid)
    if first is None:
        return Response(status_code=499)

    def chunk(delta: p.DeltaMessage, finish: str | None = None, lps: list | None = None,
              usage: p.Usage | None = None) -> p.ChatCompletionChunk:
        logprobs = p.chat_logprobs(lps) if lps is not None else None
        choices = [] if usage is not None else [p.ChatChunkChoice(delta=delta, finish_reason=finish, logprobs=logprobs)]
        return p.ChatCompletionChunk(id=rid, created=created, model=ctx.model_name, choices=choices, usage=usage)

    def chunks(out: RequestOutput, delta: str, lps: list | None) -> list[BaseModel]:
        # OpenAI ends with an empty delta that carries only finish_reason.
        result: list[BaseModel] = [chunk(p.DeltaMessage(content=delta), lps=lps)] if delta else []
        if out.finished:
            result.append(chunk(p.DeltaMessage(), finish=out.outputs[0].finish_reason,
                                lps=None if delta or lps is None else lps))
        return result

    if body.stream:
        prologue = [chunk(p.DeltaMessage(role="assistant", content=""))]
        return SSEResponse(_stream(first, gen, body.include_usage, chunks,
                                   lambda u: chunk(p.DeltaMessage(), usage=u), prologue))
    try:
        final = await _unless_disconnected(request, _last(first, gen))
    finally:
        await gen.aclose()
    if final is None:
        return Response(status_code=499)
    c = _checked(final)
    choice = p.ChatChoice(message=p.ChatResponseMessage(content=c.text), finish_reason=c.finish_reason,
                          logprobs=p.chat_logprobs(c.logprobs) if c.logprobs is not None else None)
    return p.ChatCompletionResponse(id=rid, created=created, model=ctx.model_name, choices=[choice],
                                    usage=_usage(final))


def create_app(engine: AsyncLLMEngine, api_keys: list[str] | None = None,
               shutdown_engine: bool = False) -> FastAPI:
    """The server for one engine. With shutdown_engine the app owns the engine and stops it when
    the server shuts down (launch.py); tests share one engine between apps and leave it running."""

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        if shutdown_engine:
            await engine.shutdown()

    app = FastAPI(title="Segue", lifespan=lifespan)
    app.state.serving = ServingContext(engine, engine.engine.model_name, engine.engine.max_model_len,
                                       int(time.time()))
    install_error_handlers(app)
    if api_keys:
        app.add_middleware(APIKeyMiddleware, api_keys=list(api_keys))
    app.include_router(router)
    return app
