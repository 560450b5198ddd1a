"""A replica in a Ray actor: EngineActor owns an AsyncLLMEngine; RayReplica is the pool's handle.

Streams are Ray streaming generators (num_returns="streaming") of (RequestOutput, LoadReport)
pairs. Leaving a stream early aborts the request and cancels the actor's generator. Detaching a
request ends its stream on the actor itself, and the detach call returns only once that stream is
closed: the next turn's continue_request can never find the old stream still open, and no cancel
can race the detach into an abort. Errors come back as the engine raised them
(InvalidRequestError stays a 400); a dead actor becomes EngineDeadError and marks the replica down.

Function arguments of run_sync travel by cloudpickle: functions from importable modules (the
server's, segue's) work; closures over test-module globals would not import on the actor.
"""
from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from typing import TYPE_CHECKING, Any, AsyncIterator, Awaitable, Callable

import ray
import ray.exceptions

from segue.async_engine import AsyncLLMEngine, EngineDeadError
from segue.cluster.front import ModelInfo, model_info
from segue.cluster.replica import EngineReplica, ReplicaOutput, load_report
from segue.config import EngineConfig
from segue.sampling_params import SamplingParams

if TYPE_CHECKING:
    from segue.engine import LLMEngine

logger = logging.getLogger(__name__)


def _set_tool_parser(request_id: str, parser: Any, llm: "LLMEngine") -> None:
    # The server re-arms its parser between turns; the actor's copy must be that one.
    state = llm._states.get(request_id)
    if state is not None:
        state.tool_parser = parser


async def _until_set(source: AsyncIterator[Any], stop: asyncio.Event) -> AsyncIterator[Any]:
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
        # Open streams by request id: (stop, ended) events, so detach can end one and wait for it.
        self._streams: dict[str, tuple[asyncio.Event, asyncio.Event]] = {}

    async def _serve(self, request_id: str, source: AsyncIterator[Any]) -> AsyncIterator[ReplicaOutput]:
        entry = (asyncio.Event(), asyncio.Event())
        self._streams[request_id] = entry
        try:
            async with contextlib.aclosing(source) as outs, \
                    contextlib.aclosing(_until_set(outs, entry[0])) as items:
                async for out in items:
                    yield out, load_report(self.engine.engine)
        finally:
            entry[1].set()
            if self._streams.get(request_id) is entry:
                del self._streams[request_id]

    async def describe(self) -> ModelInfo:
        return model_info(self.engine.engine)

    async def generate(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str,
                       hints: dict[str, Any]) -> AsyncIterator[ReplicaOutput]:
        async for item in self._serve(request_id, self.engine.generate(prompt_token_ids, params, request_id, **hints)):
            yield item

    async def continue_request(self, request_id: str, tokens: list[int], params: SamplingParams | None,
                               tool_parser: Any) -> AsyncIterator[ReplicaOutput]:
        previous = self._streams.get(request_id)
        if previous is not None and previous[0].is_set():
            # A detach of the last turn's stream is still closing it; continuing now would find
            # that stream open. (RayReplica also awaits the detach first: async actors do not
            # promise to run one caller's calls in order.)
            await previous[1].wait()
        if tool_parser is not None:
            await self.engine.run_sync(functools.partial(_set_tool_parser, request_id, tool_parser))
        async for item in self._serve(request_id, self.engine.continue_request(request_id, tokens, params)):
            yield item

    async def resume(self, request_id: str, tokens: list[int], params: SamplingParams | None) -> None:
        await self.engine.resume(request_id, tokens, params)

    async def detach(self, request_id: str) -> None:
        self.engine.detach(request_id)
        entry = self._streams.get(request_id)
        if entry is not None:
            entry[0].set()
            await entry[1].wait()

    async def abort(self, request_id: str) -> None:
        self.engine.abort(request_id)

    async def run_sync(self, fn: Callable[["LLMEngine"], Any]) -> Any:
        return await self.engine.run_sync(fn)

    async def set_tool_hint(self, name: str, seconds: float | None) -> None:
        self.engine.engine.tool_stats.set_hint(name, seconds)

    async def shutdown(self, drain_timeout: float) -> None:
        await self.engine.shutdown(drain_timeout)


class RayReplica(EngineReplica):
    def __init__(self, index: int, actor: Any) -> None:
        self.index = index
        self.actor = actor
        self._dead: str | None = None
        self._closing = False
        # Detach calls in flight, awaited before a stream's cancel so the actor does not abort.
        self._detaching: dict[str, Any] = {}

    def describe(self) -> ModelInfo:
        return self._unwrap_sync(lambda: ray.get(self.actor.describe.remote()))

    async def generate(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str,
                       hints: dict[str, Any]) -> AsyncIterator[ReplicaOutput]:
        stream = self.actor.generate.options(num_returns="streaming").remote(
            prompt_token_ids, params, request_id, hints)
        async for item in self._relay(request_id, stream):
            yield item

    async def continue_request(self, request_id: str, tokens: list[int], params: SamplingParams | None,
                               tool_parser: Any) -> AsyncIterator[ReplicaOutput]:
        pending = self._detaching.pop(request_id, None)
        if pending is not None:
            await self._settle(pending)
        stream = self.actor.continue_request.options(num_returns="streaming").remote(
            request_id, tokens, params, tool_parser)
        async for item in self._relay(request_id, stream):
            yield item

    async def _relay(self, request_id: str, stream: Any) -> AsyncIterator[ReplicaOutput]:
        finished = False
        try:
            async for ref in stream:
                out, load = await self._call(ref)
                finished = out.finished
                yield out, load
                if finished:
                    return
        except (ray.exceptions.RayError, EngineDeadError) as e:
            raise self._translate(e) from None
        finally:
            # Kept for continue_request to await as well, unless the request finished.
            pending = self._detaching.pop(request_id, None) if finished else self._detaching.get(request_id)
            if not finished:
                if pending is not None:
                    await self._settle(pending)
                else:
                    self.actor.abort.remote(request_id)
                ray.cancel(stream)

    async def _settle(self, ref: Any) -> None:
        try:
            await ref
        except ray.exceptions.RayError as e:
            # The actor is gone, so is the request; the stream's cancel below is all that is left.
            logger.warning("engine replica %d: detach failed: %r", self.index, self._translate(e))

    async def _call(self, ref: Awaitable[Any]) -> Any:
        try:
            return await ref
        except ray.exceptions.RayError as e:
            raise self._translate(e) from None

    def _translate(self, e: BaseException) -> BaseException:
        if isinstance(e, ray.exceptions.RayTaskError) and isinstance(e.cause, Exception):
            e = e.cause
        if isinstance(e, EngineDeadError):
            self._dead = str(e)
            return e
        if isinstance(e, (ray.exceptions.RayActorError, ray.exceptions.RayError)):
            self._dead = repr(e)
            return EngineDeadError(f"engine replica {self.index} is gone: {e!r}")
        return e

    def _unwrap_sync(self, fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except ray.exceptions.RayError as e:
            raise self._translate(e) from None

    async def resume(self, request_id: str, tokens: list[int], params: SamplingParams | None) -> None:
        await self._call(self.actor.resume.remote(request_id, tokens, params))

    def detach(self, request_id: str) -> None:
        self._detaching[request_id] = self.actor.detach.remote(request_id)

    def abort(self, request_id: str) -> None:
        self._detaching.pop(request_id, None)
        self.actor.abort.remote(request_id)

    async def run_sync(self, fn: Callable[["LLMEngine"], Any]) -> Any:
        return await self._call(self.actor.run_sync.remote(fn))

    def set_tool_hint(self, name: str, seconds: float | None) -> None:
        self.actor.set_tool_hint.remote(name, seconds)

    @property
    def is_running(self) -> bool:
        return self._dead is None and not self._closing

    async def shutdown(self, drain_timeout: float = 0.0) -> None:
        self._closing = True
        try:
            if self._dead is None:
                await self._call(self.actor.shutdown.remote(drain_timeout))
        finally:
            ray.kill(self.actor)


def create_ray_replicas(config: EngineConfig, num_replicas: int, num_cpus_per_replica: float) -> list[RayReplica]:
    """Start the actors and wait until every one has loaded the model (a bad --model fails here)."""
    actor_class = ray.remote(EngineActor)
    actors = [actor_class.options(num_cpus=num_cpus_per_replica, name=None).remote(config)
              for _ in range(num_replicas)]
    replicas = [RayReplica(i, actor) for i, actor in enumerate(actors)]
    try:
        for replica in replicas:
            replica.describe()
    except BaseException:
        for actor in actors:
            ray.kill(actor)
        raise
    return replicas
