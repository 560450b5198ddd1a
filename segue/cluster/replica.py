"""One engine replica as the pool sees it: the interface, and the load report replicas attach to outputs.

Two implementations: LocalReplica (an AsyncLLMEngine in this process) and RayReplica (an engine in
a Ray actor). Streams yield (RequestOutput, LoadReport) pairs, so the router's view of each replica's
queues is as fresh as its latest output, with no polling. A replica's streams clean up after
themselves: leaving one early aborts its request, unless the request was detached first.
"""
from __future__ import annotations

import abc
from typing import TYPE_CHECKING, Any, AsyncGenerator, Callable

from segue.cluster.router import LoadReport
from segue.outputs import RequestOutput
from segue.sampling_params import SamplingParams

if TYPE_CHECKING:
    from segue.cluster.model_info import ModelInfo
    from segue.engine import LLMEngine

ReplicaOutput = tuple[RequestOutput, LoadReport]


def load_report(llm: "LLMEngine") -> LoadReport:
    """Read off the engine thread without a lock: each len() is atomic under the GIL, the set of
    them may be one step apart, which is fine for a routing hint."""
    s = llm.scheduler
    return LoadReport(len(s.running), len(s.waiting), len(s.paused.paused), s.kv.num_used_blocks,
                      s.kv.num_blocks)


def engine_census(llm: "LLMEngine") -> dict[str, int]:
    """Requests and KV blocks an engine holds (run on its loop thread, via run_sync): after every
    request is finished or aborted both must be zero."""
    return {"requests": llm.num_unfinished_requests, "held_blocks": llm.scheduler.kv.num_held_blocks(),
            "paused": len(llm.scheduler.paused.paused)}


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
    def generate(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str,
                 hints: dict[str, Any]) -> AsyncGenerator[ReplicaOutput, None]:
        """AsyncLLMEngine.generate on this replica."""

    @abc.abstractmethod
    def continue_request(self, request_id: str, tokens: list[int], params: SamplingParams | None,
                         tool_parser: Any) -> AsyncGenerator[ReplicaOutput, None]:
        """AsyncLLMEngine.continue_request; `tool_parser` is the caller's current parser object (the
        server re-arms it between turns), for replicas that hold a copy of it."""

    @abc.abstractmethod
    async def resume(self, request_id: str, tokens: list[int], params: SamplingParams | None) -> None: ...

    @abc.abstractmethod
    def detach(self, request_id: str) -> None: ...

    @abc.abstractmethod
    def abort(self, request_id: str) -> None: ...

    @abc.abstractmethod
    def set_latency_sensitive(self, request_id: str, latency_sensitive: bool) -> None:
        """A program call's objective changed after launch (see AsyncLLMEngine)."""

    @abc.abstractmethod
    async def run_sync(self, fn: Callable[["LLMEngine"], Any]) -> Any: ...

    @abc.abstractmethod
    def set_tool_hint(self, name: str, seconds: float | None) -> None: ...

    @property
    @abc.abstractmethod
    def is_running(self) -> bool: ...

    @abc.abstractmethod
    async def shutdown(self, drain_timeout: float = 0.0) -> None: ...
