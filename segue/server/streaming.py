"""Response plumbing shared by the routes: SSE, client-disconnect handling, output checks.

A client that goes away aborts its request, streaming or not, so its KV blocks return to the pool
at once: SSE streams notice through Starlette cancelling the response task, non-streaming requests
by polling `is_disconnected` while they wait.
"""
from __future__ import annotations

import asyncio
from typing import AsyncGenerator, AsyncIterator, Awaitable, Sequence, TypeVar

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


class Prepended:
    """The stream again with its already-awaited first output in front. Closing it closes `gen`
    (which aborts the engine request) even if it was never iterated, which an async generator's
    aclose() would not do: with n choices, a stream may be dropped before anyone reads it."""

    def __init__(self, first: RequestOutput, gen: AsyncGenerator[RequestOutput, None]) -> None:
        self._first: RequestOutput | None = first
        self._gen = gen
        self._ended = False

    def __aiter__(self) -> "Prepended":
        return self

    async def __anext__(self) -> RequestOutput:
        if self._first is not None:
            out, self._first = self._first, None
            self._ended = out.finished
            return out
        if self._ended:
            raise StopAsyncIteration
        return await self._gen.__anext__()

    async def aclose(self) -> None:
        self._ended, self._first = True, None
        await self._gen.aclose()


def prepend(first: RequestOutput, gen: AsyncGenerator[RequestOutput, None]) -> Prepended:
    return Prepended(first, gen)


async def gather_all(aws: Sequence[Awaitable[T]]) -> list[T]:
    """asyncio.gather, except that when one fails (or this is cancelled) the others are cancelled
    and awaited, so no choice keeps generating for a response that will never be sent."""
    tasks = [asyncio.ensure_future(aw) for aw in aws]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def merge_streams(streams: Sequence[AsyncIterator[T]]) -> AsyncGenerator[tuple[int, T], None]:
    """Items of several streams as they come, tagged with their stream's index. Closing the merge
    (or an error in any stream) cancels and closes them all."""
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i: int, stream: AsyncIterator[T]) -> None:
        try:
            async for item in stream:
                queue.put_nowait((i, item))
        except Exception as e:  # handed to the consumer, which raises it
            queue.put_nowait((i, e))
        else:
            queue.put_nowait((i, done))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        left = len(tasks)
        while left:
            i, item = await queue.get()
            if item is done:
                left -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for stream in streams:
            close = getattr(stream, "aclose", None)
            if close is not None:
                await close()
