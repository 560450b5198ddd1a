"""One engine replica as the pool sees it: the interface, and what its streams yield.

Two implementations: LocalReplica (an AsyncLLMEngine in this process) and RayReplica (an engine in
a Ray actor). Streams yield (RequestOutput, LoadReport) pairs, so the router's view of each replica's
queues is as fresh as its latest output, with no polling. A replica's streams clean up after
themselves: leaving one early aborts its request, unless the request was detached first.
"""
from __future__ import annotations

import abc
from typing import TYPE_CHECKING, Any, AsyncGenerator, Awaitable, Callable

from segue.engine.calls import EngineCall, R
from segue.engine.engine_request import EngineRequest
from segue.engine.stats import LoadReport
from segue.outputs import RequestOutput
from segue.sampling_params import SamplingParams

if TYPE_CHECKING:
    from segue.engine.llm_engine import LLMEngine
    from segue.engine.model_info import ModelInfo

ReplicaOutput = tuple[RequestOutput, LoadReport]


def engine_census(llm: "LLMEngine") -> dict[str, int]:
    """Requests and KV blocks an engine holds (run on its loop thread, via run_sync): after every
    request is finished or aborted both must be zero."""
    return {"requests": llm.num_unfinished_requests, "held_blocks": llm.num_held_blocks(),
            "paused": llm.load_report().paused}


class EngineReplica(abc.ABC):
    index: int
    @property
    def restarts(self) -> int:
        """How many times the replica's engine was rebuilt (Ray restarted its actor); each time,
        what it cached and held is gone. In-process replicas are never rebuilt."""
        return 0

    @abc.abstractmethod
    def describe(self) -> "ModelInfo":
        """The served model (blocking; called while the pool is built)."""

    @abc.abstractmethod
    def generate(self, request: EngineRequest) -> AsyncGenerator[ReplicaOutput, None]:
        """AsyncLLMEngine.generate on this replica; the pool has named the request and tokenized
        its prompt."""

    @abc.abstractmethod
    def continue_request(self, request_id: str, tokens: list[int], params: SamplingParams | None,
                         keep: int | None = None) -> AsyncGenerator[ReplicaOutput, None]:
        """AsyncLLMEngine.continue_request."""

    @abc.abstractmethod
    async def resume(self, request_id: str, tokens: list[int], params: SamplingParams | None,
                     keep: int | None = None) -> None: ...

    @abc.abstractmethod
    def detach(self, request_id: str) -> None: ...

    @abc.abstractmethod
    def set_latency_sensitive(self, request_id: str, latency_sensitive: bool) -> None:
        """A program call's objective changed after launch (see AsyncLLMEngine)."""

    @abc.abstractmethod
    def call(self, op: EngineCall[R]) -> Awaitable[R]:
        """AsyncLLMEngine.call on this replica (an Abort is sent before this returns)."""

    @abc.abstractmethod
    async def run_sync(self, fn: Callable[["LLMEngine"], Any]) -> Any:
        """fn(engine) on the replica's engine thread (tests and benchmarks only, not the server)."""

    @abc.abstractmethod
    def set_tool_hint(self, name: str, seconds: float | None) -> None: ...

    @property
    @abc.abstractmethod
    def is_running(self) -> bool: ...

    @abc.abstractmethod
    async def shutdown(self, drain_timeout: float = 0.0) -> None: ...
