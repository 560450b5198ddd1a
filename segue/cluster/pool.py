"""EnginePool: an EngineClient (segue/engine/protocol.py) over several engine replicas.

The server keeps talking to "the engine"; the pool places each new request with its Router and
sends everything that follows (continue, resume, detach, and each RequestCall: abort, the
paused-request questions) to the replica that holds it. The model side (tokenization, chat
template, prompt checks) is answered here, in the server's process, by the same InputProcessor
the engines use, over the ModelInfo replica 0 describes (replicas all serve the same checkpoint).
Tool duration hints fan out to every replica.

A GetStats call merges the live replicas' snapshots as EngineStats.merge says: /metrics thus reports
sums over replicas (queues, KV blocks, waste, prefix hits, steps); tool duration quantiles are per
replica (the one with most observations is shown). `is_running` (/health) is true only while
every replica is; a Ray replica's death is noticed on the next call that reaches it. Ray
restarts a dead replica (up to --engine-restarts times); once it answers again the pool routes to
it again, and a restart makes the router forget the prefixes
and program bindings it had placed there (their cache is gone). Requests that were paused on it are
gone too: the server's held-session check finds nothing there and starts the next turn fresh
(while the replica is still down, that turn fails with 503 instead).
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import uuid
from typing import Any, AsyncGenerator, Awaitable, Callable, Sequence, cast

from segue.cluster.replica import EngineReplica, ReplicaOutput
from segue.cluster.router import Router, RouteRequest
from segue.engine.async_engine import remember_early
from segue.engine.calls import Abort, Answered, EngineCall, GetStats, R, RequestCall
from segue.engine.engine_request import EngineRequest
from segue.engine.input_processor import InputProcessor
from segue.engine.model_info import ModelInfo
from segue.engine.protocol import EngineDeadError
from segue.engine.stats import EngineStats
from segue.outputs import RequestOutput
from segue.sampling_params import InvalidRequestError, SamplingParams

logger = logging.getLogger(__name__)


class EnginePool:
    def __init__(self, replicas: Sequence[EngineReplica], router: Router,
                 on_shutdown: Callable[[], None] | None = None) -> None:
        if not replicas or router.num_replicas != len(replicas):
            raise ValueError(f"the router expects {router.num_replicas} replicas, got {len(replicas)}")
        self.replicas = list(replicas)
        self.router = router
        self.inputs = InputProcessor(self.replicas[0].describe())
        self._on_shutdown = on_shutdown
        self._closing = False
        self._restarts_seen = [r.restarts for r in self.replicas]
        # Request id -> replica index, from placement until the request is gone (finished, aborted).
        self._owners: dict[str, int] = {}
        self._streaming: set[str] = set()
        self._detached: set[str] = set()
        self._prompts: dict[str, str] = {}
        # Objectives updated before their request was placed (set_latency_sensitive).
        self._early_objectives: dict[str, bool] = {}

    # ---- the model (EngineClient) ------------------------------------------------------------
    def model_info(self) -> ModelInfo:
        return self.inputs.info

    def encode(self, text: str) -> list[int]:
        return self.inputs.encode(text)

    def decode(self, token_ids: list[int]) -> str:
        return self.inputs.decode(token_ids)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None) -> str:
        return self.inputs.apply_chat_template(messages, add_generation_prompt, tools)

    # ---- requests (EngineClient) -------------------------------------------------------------
    async def generate(self, request: EngineRequest) -> AsyncGenerator[RequestOutput, None]:
        """The prompt is checked here, before routing (a bad one never reaches the router's prefix
        index); the replica builds the request from its token ids. The task group is the
        router's alone."""
        self._check_alive()
        rid = request.request_id or uuid.uuid4().hex
        self._check_free(rid)
        loop = asyncio.get_running_loop()
        _, token_ids = await loop.run_in_executor(None, self.inputs.process, request.prompt, request.params)
        self._check_alive()
        self._check_free(rid)
        self._sync_availability()
        hints = request.hints
        decision = self.router.route(RouteRequest(rid, token_ids, hints.program_id, hints.task_group,
                                                  hints.cache_salt))
        replica = self.replicas[decision.replica]
        self._owners[rid] = decision.replica
        latency_sensitive = self._early_objectives.pop(rid, hints.latency_sensitive)
        placed = dataclasses.replace(request, prompt=token_ids, request_id=rid,
                                     hints=dataclasses.replace(hints, latency_sensitive=latency_sensitive))
        if isinstance(request.prompt, str):
            self._prompts[rid] = request.prompt
        async for out in self._stream(rid, replica, replica.generate(placed)):
            yield out

    async def continue_request(self, request_id: str, tokens: list[int], params: SamplingParams | None = None,
                               keep: int | None = None) -> AsyncGenerator[RequestOutput, None]:
        self._check_alive()
        replica = self._replica_of(request_id)
        if request_id in self._streaming:
            raise InvalidRequestError(f"request {request_id!r} is still streaming")
        self._detached.discard(request_id)
        source = replica.continue_request(request_id, tokens, params, keep)
        async for out in self._stream(request_id, replica, source):
            yield out

    async def resume(self, request_id: str, tokens: list[int], params: SamplingParams | None = None,
                     keep: int | None = None) -> None:
        self._check_alive()
        await self._replica_of(request_id).resume(request_id, tokens, params, keep)

    def detach(self, request_id: str) -> None:
        index = self._owners.get(request_id)
        if index is not None:
            self._detached.add(request_id)
            self.replicas[index].detach(request_id)

    def forget_program(self, program_id: str) -> None:
        """A program or session ended: unbind it so the router stops steering to its replica."""
        self.router.forget_program(program_id)

    def set_latency_sensitive(self, request_id: str, latency_sensitive: bool) -> None:
        """Forwarded to the replica holding the request; one not yet placed takes it as a hint."""
        index = self._owners.get(request_id)
        if index is not None:
            self.replicas[index].set_latency_sensitive(request_id, latency_sensitive)
        else:
            remember_early(self._early_objectives, request_id, latency_sensitive)

    def set_tool_hint(self, name: str, seconds: float | None) -> None:
        for replica in self.replicas:
            replica.set_tool_hint(name, seconds)

    # ---- calls about requests, and stats (EngineClient) -------------------------------------
    def call(self, op: EngineCall[R]) -> Awaitable[R]:
        """A call about a request goes to the replica holding it; none holds it: the call's own
        answer for that (RequestCall.answer_if_absent). Stats are merged over the live replicas."""
        if isinstance(op, GetStats):
            self._check_alive()
            return cast("Awaitable[R]", self._merged_stats())
        if not isinstance(op, RequestCall):
            raise TypeError(f"not an engine call: {op!r}")
        if not isinstance(op, Abort):
            # An abort is how a closing stream cleans up, even on the way down: it is always sent.
            self._check_alive()
        index = self._owners.get(op.request_id)
        if index is None:
            return Answered(op.answer_if_absent())
        answer = self.replicas[index].call(op)
        if isinstance(op, Abort):
            self._detached.discard(op.request_id)
            if op.request_id not in self._streaming:
                self._forget(op.request_id)
        return answer

    async def _merged_stats(self) -> EngineStats:
        live = [r for r in self.replicas if r.is_running]
        return EngineStats.merge(await asyncio.gather(*(r.call(GetStats()) for r in live)))

    async def run_sync(self, fn: Callable[[Any], Any], request_id: str | None = None) -> Any:
        """fn(LLMEngine) on the replica holding request_id, or else on every live replica: their
        answers in replica order (tests and benchmarks; the server asks by named methods)."""
        self._check_alive()
        if request_id is not None:
            return await self._replica_of(request_id).run_sync(fn)
        live = [r for r in self.replicas if r.is_running]
        return list(await asyncio.gather(*(r.run_sync(fn) for r in live)))

    @property
    def is_running(self) -> bool:
        if self._closing:
            return False
        # /health asks often, so a replica's return is usually first seen here, before any routing.
        self._sync_availability()
        return all(self.router.is_available(i) for i in range(len(self.replicas)))

    @property
    def num_unfinished_requests(self) -> int:
        return len(self._streaming)

    async def shutdown(self, drain_timeout: float = 0.0) -> None:
        if self._closing:
            return
        self._closing = True
        results = await asyncio.gather(*(r.shutdown(drain_timeout) for r in self.replicas), return_exceptions=True)
        for replica, result in zip(self.replicas, results, strict=True):
            if isinstance(result, BaseException):
                logger.warning("engine replica %d did not shut down cleanly: %r", replica.index, result)
        if self._on_shutdown is not None:
            await asyncio.get_running_loop().run_in_executor(None, self._on_shutdown)

    # ---- introspection (benchmarks, tests) -----------------------------------------------
    def owner_of(self, request_id: str) -> int | None:
        return self._owners.get(request_id)

    # ---- internals -----------------------------------------------------------------------
    async def _stream(self, rid: str, replica: EngineReplica,
                      source: AsyncGenerator[ReplicaOutput, None]) -> AsyncGenerator[RequestOutput, None]:
        self._streaming.add(rid)
        finished = False
        try:
            async with contextlib.aclosing(source) as outputs:
                async for out, load in outputs:
                    self.router.report_load(replica.index, load)
                    self.router.confirm(rid)
                    prompt = self._prompts.get(rid)
                    if prompt is not None:
                        out.prompt = prompt
                    finished = out.finished
                    yield out
                    if finished:
                        return
        finally:
            self.router.confirm(rid)
            self._streaming.discard(rid)
            if not finished and rid not in self._detached:
                # The replica's stream aborted it already when it was open; not when opening failed
                # (continue_request of a request still paused): abort is idempotent, so always.
                replica.call(Abort(rid))
            if finished or rid not in self._detached:
                self._forget(rid)

    def _sync_availability(self) -> None:
        for i, replica in enumerate(self.replicas):
            up = replica.is_running  # first: a Ray replica learns of its restart while polling
            if replica.restarts != self._restarts_seen[i]:
                self._restarts_seen[i] = replica.restarts
                logger.info("engine replica %d was restarted: forgetting the prefixes and programs placed there", i)
                self.router.forget_replica(i)
            if up != self.router.is_available(i):
                if up:
                    logger.warning("engine replica %d is up; routing to it again", i)
                else:
                    logger.error("engine replica %d is down; routing around it", i)
                self.router.set_available(i, up)

    def _forget(self, rid: str) -> None:
        self._owners.pop(rid, None)
        self._detached.discard(rid)
        self._prompts.pop(rid, None)

    def _replica_of(self, request_id: str) -> EngineReplica:
        replica = self._owner(request_id)
        if replica is None:
            raise InvalidRequestError(f"request {request_id!r} is not paused")
        return replica

    def _owner(self, request_id: str) -> EngineReplica | None:
        self._check_alive()
        index = self._owners.get(request_id)
        return self.replicas[index] if index is not None else None

    def _check_free(self, rid: str) -> None:
        if rid in self._owners:
            raise InvalidRequestError(f"request id {rid!r} is already in use")

    def _check_alive(self) -> None:
        if self._closing:
            raise EngineDeadError("the engine pool is shut down")
        if not any(r.is_running for r in self.replicas):
            raise EngineDeadError("every engine replica is gone")
