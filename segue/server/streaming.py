"""Response plumbing shared by the routes: SSE, client-disconnect handling, output checks.

A client that goes away aborts its request, streaming or not, so its KV blocks return to the pool
at once: SSE streams notice through Starlette cancelling the response task, non-streaming requests
by polling `is_disconnected` while they wait.
"""
from __future__ import annotations

import asyncio
from typing import AsyncGenerator, Awaitable, TypeVar

import anyio
from fastapi import Request
from pydantic import BaseModel
from starlette.responses import StreamingResponse
from starlette.types import Send

from segue.outputs import CompletionOutput, RequestOutput
from segue.server.errors import APIError

T = TypeVar("T")
# How often a non-streaming request checks whether its client is still connected.
DISCONNECT_POLL_S = 0.25


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


def sse(obj: BaseModel) -> str:
    return f"data: {obj.model_dump_json()}\n\n"


def checked(out: RequestOutput) -> CompletionOutput:
    c = out.outputs[0]
    if c.finish_reason == "abort":
        raise APIError(503, "the request was aborted by the server (shutting down, session closed or engine "
                            "failure)", code="request_aborted")
    return c


async def unless_disconnected(request: Request, aw: Awaitable[T]) -> T | None:
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


async def prepend(first: RequestOutput,
                  gen: AsyncGenerator[RequestOutput, None]) -> AsyncGenerator[RequestOutput, None]:
    """The stream again with its already-awaited first output in front; closing it closes `gen`."""
    try:
        yield first
        if not first.finished:
            async for out in gen:
                yield out
    finally:
        await gen.aclose()
