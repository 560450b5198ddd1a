"""A replica in this process: an AsyncLLMEngine behind the EngineReplica interface (no Ray)."""
from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any, AsyncGenerator, Awaitable, Callable

from segue.cluster.replica import EngineReplica, ReplicaOutput
from segue.engine.async_engine import AsyncLLMEngine
from segue.engine.calls import EngineCall, R
from segue.engine.engine_request import EngineRequest
from segue.engine.model_info import ModelInfo
from segue.sampling_params import SamplingParams

if TYPE_CHECKING:
    from segue.engine.llm_engine import LLMEngine


class LocalReplica(EngineReplica):
    def __init__(self, index: int, engine: AsyncLLMEngine) -> None:
        self.index = index
        self.engine = engine

    def describe(self) -> ModelInfo:
        return self.engine.model_info()

    async def generate(self, request: EngineRequest) -> AsyncGenerator[ReplicaOutput, None]:
        # aclosing: leaving this stream must close the engine's at once (its finally aborts the request).
        async with contextlib.aclosing(self.engine.generate(request)) as outs:
            async for out in outs:
                yield out, self.engine.load_report()

    async def continue_request(self, request_id: str, tokens: list[int], params: SamplingParams | None,
                               keep: int | None = None) -> AsyncGenerator[ReplicaOutput, None]:
        async with contextlib.aclosing(self.engine.continue_request(request_id, tokens, params, keep)) as outs:
            async for out in outs:
                yield out, self.engine.load_report()

    async def resume(self, request_id: str, tokens: list[int], params: SamplingParams | None,
                     keep: int | None = None) -> None:
        await self.engine.resume(request_id, tokens, params, keep)

    def detach(self, request_id: str) -> None:
        self.engine.detach(request_id)

    def set_latency_sensitive(self, request_id: str, latency_sensitive: bool) -> None:
        self.engine.set_latency_sensitive(request_id, latency_sensitive)

    def call(self, op: EngineCall[R]) -> Awaitable[R]:
        return self.engine.call(op)

    async def run_sync(self, fn: Callable[["LLMEngine"], Any]) -> Any:
        return await self.engine.run_sync(fn)

    def set_tool_hint(self, name: str, seconds: float | None) -> None:
        self.engine.set_tool_hint(name, seconds)

    @property
    def is_running(self) -> bool:
        return self.engine.is_running

    async def shutdown(self, drain_timeout: float = 0.0) -> None:
        await self.engine.shutdown(drain_timeout)
