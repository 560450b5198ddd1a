"""A replica in a Ray actor: EngineActor (ray_actor.py) owns an AsyncLLMEngine; RayReplica is the
pool's handle.

Streams are Ray streaming generators (num_returns="streaming") of (RequestOutput, LoadReport)
pairs, each tagged with the actor's incarnation. Leaving a stream early aborts the request and
cancels the actor's generator. Detaching a request ends its stream on the actor itself, and the
detach call returns only once that stream is closed: the next turn's continue_request can never
find the old stream still open, and no cancel can race the detach into an abort. Errors come
back as the engine raised them (InvalidRequestError stays a 400); a dead actor becomes
EngineDeadError and marks the replica down.

Actors have `max_restarts`: Ray rebuilds a crashed one, and the replica comes back up once its ping
answers (ray_health.py). Calls to a replica that is down fail at once with EngineDeadError rather
than wait on Ray. An engine whose step loop died inside a live actor exits its process when pinged,
so that Ray restarts it like any crash.

Function arguments of run_sync travel by cloudpickle: functions from importable modules (the
server's, segue's) work; closures over test-module globals would not import on the actor.
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, AsyncGenerator, Awaitable, Callable, cast

import ray
import ray.exceptions

from segue.cluster.ray_actor import EngineActor
from segue.cluster.ray_health import ActorHealth
from segue.cluster.replica import EngineReplica, ReplicaOutput
from segue.config import EngineConfig
from segue.engine.calls import Abort, Answered, EngineCall, R
from segue.engine.engine_request import EngineRequest
from segue.engine.model_info import ModelInfo
from segue.engine.protocol import EngineDeadError
from segue.sampling_params import SamplingParams

if TYPE_CHECKING:
    from segue.engine.llm_engine import LLMEngine

logger = logging.getLogger(__name__)


class RayReplica(EngineReplica):
    def __init__(self, index: int, actor: Any, max_restarts: int = 0) -> None:
        self.index = index
        self.actor = actor
        self.health = ActorHealth(index, actor.ping.remote, max_restarts, on_restart=self._resend_hints)
        self._closing = False
        # Detach calls in flight, awaited before a stream's cancel so the actor does not abort.
        self._detaching: dict[str, Any] = {}
        # Re-sent to an actor Ray restarted: its new engine starts without them.
        self._tool_hints: dict[str, float | None] = {}

    def connect(self) -> None:
        """Wait until the actor has built its engine (a bad --model fails here)."""
        try:
            incarnation = ray.get(self.actor.ping.remote())
        except ray.exceptions.RayError as e:
            # Not a replica going down (nothing to restart: Ray does not retry a failed constructor).
            raise EngineDeadError(f"engine replica {self.index} did not start: {e}") from None
        self.health.observe(incarnation)

    def describe(self) -> ModelInfo:
        return self._unwrap_sync(lambda: ray.get(self.actor.describe.remote()))

    @property
    def restarts(self) -> int:
        return self.health.restarts

    async def generate(self, request: EngineRequest) -> AsyncGenerator[ReplicaOutput, None]:
        self._check_up()
        assert request.request_id is not None, "the pool names a request before placing it"
        stream = self.actor.generate.options(num_returns="streaming").remote(request)
        async for item in self._relay(request.request_id, stream):
            yield item

    async def continue_request(self, request_id: str, tokens: list[int], params: SamplingParams | None,
                               keep: int | None = None) -> AsyncGenerator[ReplicaOutput, None]:
        self._check_up()
        pending = self._detaching.pop(request_id, None)
        if pending is not None:
            await self._settle(pending)
        stream = self.actor.continue_request.options(num_returns="streaming").remote(
            request_id, tokens, params, keep)
        async for item in self._relay(request_id, stream):
            yield item

    async def _relay(self, request_id: str, stream: Any) -> AsyncGenerator[ReplicaOutput, None]:
        finished = False
        try:
            async for ref in stream:
                out, load, incarnation = await self._call(ref)
                self.health.observe(incarnation)
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
                    self.actor.call.remote(Abort(request_id))
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
            self.health.mark_down(str(e))
            return e
        if isinstance(e, ray.exceptions.RayError):
            self.health.mark_down(type(e).__name__)
            return EngineDeadError(f"engine replica {self.index} is down: {e!r}")
        return e

    def _check_up(self) -> None:
        # A call to an actor Ray is restarting would wait a second or two and then fail anyway.
        if not self.is_running:
            raise EngineDeadError(f"engine replica {self.index} is down: {self.health.down or 'shut down'}")

    def _resend_hints(self) -> None:
        for name, seconds in self._tool_hints.items():
            self.actor.set_tool_hint.remote(name, seconds)

    def _unwrap_sync(self, fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except ray.exceptions.RayError as e:
            raise self._translate(e) from None

    async def resume(self, request_id: str, tokens: list[int], params: SamplingParams | None,
                     keep: int | None = None) -> None:
        self._check_up()
        await self._call(self.actor.resume.remote(request_id, tokens, params, keep))

    def detach(self, request_id: str) -> None:
        self._detaching[request_id] = self.actor.detach.remote(request_id)

    def set_latency_sensitive(self, request_id: str, latency_sensitive: bool) -> None:
        # Fire and forget, like an Abort: a replica that is down has no request to update.
        self.actor.set_latency_sensitive.remote(request_id, latency_sensitive)

    def call(self, op: EngineCall[R]) -> Awaitable[R]:
        if isinstance(op, Abort):
            # Fire and forget: a replica that is down has no request left to abort.
            self._detaching.pop(op.request_id, None)
            self.actor.call.remote(op)
            return cast("Awaitable[R]", Answered(None))  # an Abort's R is None
        self._check_up()
        return self._call(self.actor.call.remote(op))

    async def run_sync(self, fn: Callable[["LLMEngine"], Any]) -> Any:
        self._check_up()
        return await self._call(self.actor.run_sync.remote(fn))

    def set_tool_hint(self, name: str, seconds: float | None) -> None:
        self._tool_hints[name] = seconds
        self.actor.set_tool_hint.remote(name, seconds)

    @property
    def is_running(self) -> bool:
        return not self._closing and self.health.poll()

    async def shutdown(self, drain_timeout: float = 0.0) -> None:
        self._closing = True
        try:
            if self.health.is_up:
                await self._call(self.actor.shutdown.remote(drain_timeout))
        finally:
            ray.kill(self.actor)


def create_ray_replicas(config: EngineConfig, num_replicas: int, num_cpus_per_replica: float,
                        max_restarts: int = 0) -> list[RayReplica]:
    """Start the actors and wait until every one has loaded the model (a bad --model fails here).
    Ray restarts a crashed actor up to max_restarts times (an exception in the constructor is not
    retried). No task is retried: a retried generate would run its request twice."""
    if max_restarts < 0:
        raise ValueError(f"max_restarts must be >= 0 (bounded), got {max_restarts}")
    actor_class = ray.remote(EngineActor)
    actors = [actor_class.options(num_cpus=num_cpus_per_replica, name=None, max_restarts=max_restarts,
                                  max_task_retries=0).remote(config)
              for _ in range(num_replicas)]
    replicas = [RayReplica(i, actor, max_restarts) for i, actor in enumerate(actors)]
    try:
        for replica in replicas:
            replica.connect()
    except BaseException:
        for actor in actors:
            ray.kill(actor)  # type: ignore[arg-type]  # ray's stubs type .remote()'s result as a union
        raise
    return replicas
