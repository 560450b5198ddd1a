"""The async engine's per-request output streams: engine thread -> caller's event loop.

Each open request has an asyncio queue on its caller's event loop. The engine thread delivers
every output (or an error) into it thread-safely; the caller's generator reads it. A stream ends
with its request's last output or an error; a pause keeps it open (a server-side tool's result
continues on it). A caller that stops reading early aborts the request, unless the request was
detached (a session holds it paused for a later turn, which opens a new stream).
"""
from __future__ import annotations

import asyncio
from typing import AsyncGenerator, Callable

from segue.outputs import RequestOutput


class OutputStreams:
    """Opened and read on callers' event loops, delivered into from the engine thread."""

    def __init__(self) -> None:
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        # Requests whose stream may close without aborting them (AsyncLLMEngine.detach).
        self.detached: set[str] = set()

    def open(self, request_id: str) -> asyncio.Queue:
        """A new stream for `request_id`, read on the running event loop."""
        queue: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = (asyncio.get_running_loop(), queue)
        return queue

    def discard(self, request_id: str) -> None:
        self._streams.pop(request_id, None)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._streams

    def __len__(self) -> int:
        return len(self._streams)

    def request_ids(self) -> list[str]:
        return list(self._streams)

    def deliver(self, output: RequestOutput | BaseException | None, request_id: str | None = None) -> None:
        """Hand an output (or an error, with its request's id) to its stream, if it has one open.
        The last output or an error closes the stream."""
        if output is None:
            return
        if request_id is None:
            assert isinstance(output, RequestOutput), "an error is delivered with its request's id"
            request_id = output.request_id
        rid = request_id
        stream = self._streams.get(rid)
        if stream is None:
            return
        if isinstance(output, BaseException) or output.finished:
            del self._streams[rid]
        loop, queue = stream
        if loop.is_closed():
            return  # the caller's event loop ended (asyncio.run per call): nobody reads this stream
        loop.call_soon_threadsafe(queue.put_nowait, output)

    async def consume(self, rid: str, queue: asyncio.Queue,
                      abort: Callable[[str], None]) -> AsyncGenerator[RequestOutput, None]:
        """The outputs of `rid`'s stream until its last one; raises a delivered error. Left
        early, it calls abort(rid) unless the request is detached."""
        finished = False
        try:
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished and rid not in self.detached:
                abort(rid)
            elif rid in self.detached:
                self._streams.pop(rid, None)
