"""The actor side of a Ray replica: EngineActor owns an AsyncLLMEngine in the actor's process.

Streams are async generators that Ray relays as streaming generators, one item per output:
(RequestOutput, LoadReport, incarnation). The incarnation is drawn in the constructor, which Ray
re-runs when it restarts a crashed actor; RayReplica (ray_replica.py) reads it to notice a restart.
Detaching a request ends its stream here, and detach returns only once that stream is closed.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import uuid
from typing import TYPE_CHECKING, Any, AsyncGenerator, Callable

from segue.config import EngineConfig
from segue.engine.async_engine import AsyncLLMEngine
from segue.engine.calls import EngineCall, R
from segue.engine.engine_request import EngineRequest
from segue.engine.model_info import ModelInfo
from segue.engine.stats import LoadReport
from segue.outputs import RequestOutput
from segue.sampling_params import SamplingParams

if TYPE_CHECKING:
    from segue.engine.llm_engine import LLMEngine

logger = logging.getLogger(__name__)

ActorOutput = tuple[RequestOutput, LoadReport, int]


async def _until_set(source: AsyncGenerator[Any, None], stop: asyncio.Event) -> AsyncGenerator[Any, None]:
    """source's items until `stop` is set; then the pending read is cancelled (which closes source)."""
    stopper = asyncio.ensure_future(stop.wait())
    try:
        while True:
            item = asyncio.ensure_future(anext(source))
            await asyncio.wait({item, stopper}, return_when=asyncio.FIRST_COMPLETED)
            if stop.is_set():
                item.cancel()
                await asyncio.wait({item})  # let the engine stream's own cleanup run
                return
            try:
                yield item.result()
            except StopAsyncIteration:
                return
    finally:
        stopper.cancel()


class EngineActor:
    """Runs inside the actor process (an async actor: every method runs on its event loop)."""

    def __init__(self, config: EngineConfig) -> None:
        self.engine = AsyncLLMEngine.from_config(config)
        # Tags this process's answers, so the replica tells a restarted actor (nothing cached, no
        # paused requests) from one that was only unreachable for a moment.
        self.incarnation = uuid.uuid4().int >> 64
        self._stopping = False
        # Open streams by request id: (stop, ended) events, so detach can end one and wait for it.
        self._streams: dict[str, tuple[asyncio.Event, asyncio.Event]] = {}

    async def _serve(self, request_id: str, source: AsyncGenerator[Any, None]) -> AsyncGenerator[ActorOutput, None]:
        entry = (asyncio.Event(), asyncio.Event())
        self._streams[request_id] = entry
        try:
            async with contextlib.aclosing(source) as outs, \
                    contextlib.aclosing(_until_set(outs, entry[0])) as items:
                async for out in items:
                    yield out, self.engine.load_report(), self.incarnation
        finally:
            entry[1].set()
            if self._streams.get(request_id) is entry:
                del self._streams[request_id]

    async def describe(self) -> ModelInfo:
        return self.engine.model_info()

    async def ping(self) -> int:
        if not self.engine.is_running and not self._stopping:
            # The step loop died but the process lives, and Ray restarts only processes that die:
            # exit as a crash would, so the engine is rebuilt (counted against max_restarts).
            logger.error("engine loop is dead; exiting so that Ray restarts this actor")
            os._exit(1)
        return self.incarnation

    async def generate(self, request: EngineRequest) -> AsyncGenerator[ActorOutput, None]:
        assert request.request_id is not None, "the pool names a request before placing it"
        async for item in self._serve(request.request_id, self.engine.generate(request)):
            yield item

    async def continue_request(self, request_id: str, tokens: list[int], params: SamplingParams | None,
                               keep: int | None = None) -> AsyncGenerator[ActorOutput, None]:
        previous = self._streams.get(request_id)
        if previous is not None and previous[0].is_set():
            # A detach of the last turn's stream is still closing it; continuing now would find
            # that stream open. (RayReplica also awaits the detach first: async actors do not
            # promise to run one caller's calls in order.)
            await previous[1].wait()
        async for item in self._serve(request_id, self.engine.continue_request(request_id, tokens, params, keep)):
            yield item

    async def resume(self, request_id: str, tokens: list[int], params: SamplingParams | None,
                     keep: int | None = None) -> None:
        await self.engine.resume(request_id, tokens, params, keep)

    async def detach(self, request_id: str) -> None:
        self.engine.detach(request_id)
        entry = self._streams.get(request_id)
        if entry is not None:
            entry[0].set()
            await entry[1].wait()

    async def set_latency_sensitive(self, request_id: str, latency_sensitive: bool) -> None:
        self.engine.set_latency_sensitive(request_id, latency_sensitive)

    async def call(self, op: EngineCall[R]) -> R:
        return await self.engine.call(op)

    async def run_sync(self, fn: Callable[["LLMEngine"], Any]) -> Any:
        return await self.engine.run_sync(fn)

    async def set_tool_hint(self, name: str, seconds: float | None) -> None:
        self.engine.set_tool_hint(name, seconds)

    async def shutdown(self, drain_timeout: float) -> None:
        self._stopping = True
        await self.engine.shutdown(drain_timeout)
