"""AsyncLLMEngine: the engine for asyncio callers, an EngineClient (engine/protocol.py).

Callers never touch engine state directly. Validation and tokenization run in the caller's
worker thread; adds, aborts and the paused-request methods are queued to the engine's own thread
(engine/engine_thread.py), which applies them between steps, so a long step never blocks the
event loop and no lock is held across a forward pass. Outputs come back on per-request streams
(engine/streams.py).
"""
from __future__ import annotations

import asyncio
import contextlib
from typing import Any, AsyncGenerator, Awaitable, Callable, cast

from segue.config import EngineConfig
from segue.engine.calls import Abandon, Abort, Answered, EngineCall, ExpectResume, GetStats, HeldTokens, R
from segue.engine.engine_request import EngineRequest
from segue.engine.engine_thread import EngineThread, build_off_caller_thread
from segue.engine.llm_engine import LLMEngine
from segue.engine.model_info import ModelInfo
from segue.engine.protocol import EngineDeadError
from segue.engine.stats import LoadReport
from segue.engine.streams import OutputStreams
from segue.outputs import RequestOutput
from segue.sampling_params import InvalidRequestError, SamplingParams

__all__ = ["AsyncLLMEngine", "EngineDeadError", "build_off_caller_thread", "remember_early"]


def remember_early(early: dict[str, bool], request_id: str, latency_sensitive: bool, limit: int = 10_000) -> None:
    """Keep an objective for a request not seen yet, dropping the oldest past `limit`."""
    if request_id not in early and len(early) >= limit:
        early.pop(next(iter(early)))
    early[request_id] = latency_sensitive


class AsyncLLMEngine:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.streams = OutputStreams()
        # Set by shutdown() at once, so no new request can slip in while the loop winds down.
        self._closing = False
        # Objectives that arrived before their request reached the engine (loop thread only).
        self._early_objectives: dict[str, bool] = {}
        self.engine_thread = EngineThread(engine, self.streams)

    @classmethod
    def from_config(cls, config: EngineConfig) -> "AsyncLLMEngine":
        return cls(build_off_caller_thread(lambda: LLMEngine(config)))

    # ---- the model (EngineClient) ------------------------------------------------------------
    def model_info(self) -> ModelInfo:
        return self.engine.model_info()

    def encode(self, text: str) -> list[int]:
        return self.engine.encode(text)

    def decode(self, token_ids: list[int]) -> str:
        return self.engine.decode(token_ids)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None) -> str:
        return self.engine.apply_chat_template(messages, add_generation_prompt, tools)

    # ---- requests (EngineClient) ---------------------------------------------------------
    async def generate(self, request: EngineRequest) -> AsyncGenerator[RequestOutput, None]:
        """Yields the cumulative output after every new token; the last one has finished=True.
        Leaving the iterator early (client disconnect, cancellation) aborts the request, unless
        it was detach()ed. One engine has nowhere to place a task group: that hint is ignored."""
        self._check_alive()
        loop = asyncio.get_running_loop()
        state = await loop.run_in_executor(None, self.engine.make_request, request)
        self._check_alive()
        rid = state.request.request_id
        if rid in self.streams:
            raise InvalidRequestError(f"request id {rid!r} is already in use")
        queue = self.streams.open(rid)

        def add() -> None:
            try:
                if rid in self._early_objectives:
                    state.request.latency_sensitive = self._early_objectives.pop(rid)
                self.engine.add_prepared(state)
            except Exception as e:  # reaches this request's caller only
                self.streams.deliver(e, rid)
        self.engine_thread.submit(add)
        # aclosing: when this generator is closed at its yield, the consumer closes (and aborts the
        # request) now; a bare `async for` leaves that to the consumer's finalizer, which waits for
        # the garbage collector whenever a reference cycle holds it: seconds generating for nobody.
        async with contextlib.aclosing(self.streams.consume(rid, queue, self._abort_on_close)) as outputs:
            async for item in outputs:
                yield item

    async def resume(self, request_id: str, tokens: list[int], params: SamplingParams | None = None,
                     keep: int | None = None) -> None:
        """End the interception of a paused request whose stream is still open (a server-side
        tool finished): its outputs continue on that stream."""
        self._check_alive()
        loop = asyncio.get_running_loop()
        # A new constraint compiles here, on a worker thread: on the engine thread a cold compile
        # would stall every request in the batch.
        compiled = (await loop.run_in_executor(None, self.engine.compile_grammar, params)
                    if params is not None and params.structured is not None else None)
        done = loop.create_future()

        def op() -> None:
            try:
                self.engine.resume(request_id, tokens, params, compiled, keep)
            except Exception as e:
                loop.call_soon_threadsafe(done.set_exception, e)
            else:
                loop.call_soon_threadsafe(done.set_result, None)
        self.engine_thread.submit(op)
        await done

    async def continue_request(self, request_id: str, tokens: list[int], params: SamplingParams | None = None,
                               keep: int | None = None) -> AsyncGenerator[RequestOutput, None]:
        """Resume a paused request whose previous stream was closed (a session's next turn) and
        stream it anew."""
        self._check_alive()
        if request_id in self.streams:
            raise InvalidRequestError(f"request {request_id!r} is still streaming")
        self.streams.detached.discard(request_id)
        queue = self.streams.open(request_id)
        try:
            await self.resume(request_id, tokens, params, keep)
        except BaseException:
            self.streams.discard(request_id)
            raise
        async with contextlib.aclosing(self.streams.consume(request_id, queue, self._abort_on_close)) as outputs:
            async for item in outputs:
                yield item

    def detach(self, request_id: str) -> None:
        """Keep a paused request alive when its stream closes (a session holds it for a later
        turn); it leaves only by continue_request() or an Abort call."""
        self.streams.detached.add(request_id)

    def set_latency_sensitive(self, request_id: str, latency_sensitive: bool) -> None:
        """A program's DAG grew after this call reached the engine (its map calls arrive before
        the reduce that makes them a task group): the scheduler's latency capacity reads the new
        objective from the next step on. A request still on its way in gets it when added."""
        def op() -> None:
            if not self.engine.set_latency_sensitive(request_id, latency_sensitive):
                # Bounded: an update for a request that already left is never claimed.
                remember_early(self._early_objectives, request_id, latency_sensitive)
        self.engine_thread.submit(op)

    def set_tool_hint(self, name: str, seconds: float | None) -> None:
        # DurationStats takes its own lock: no need to wait for the engine thread.
        self.engine.tool_stats.set_hint(name, seconds)

    # ---- calls about requests, and stats (EngineClient) ------------------------------------
    def call(self, op: EngineCall[R]) -> Awaitable[R]:
        """The one place that says what each EngineCall does to the engine (engine/calls.py);
        the layers above only carry calls here."""
        return cast("Awaitable[R]", self._dispatch(op))

    def _dispatch(self, op: EngineCall[Any]) -> Awaitable[Any]:
        match op:
            case Abort(request_id=rid):
                self.streams.detached.discard(rid)
                self.engine_thread.submit(lambda: self.streams.deliver(self.engine.abort_request(rid)))
                return Answered(None)
            case HeldTokens(request_id=rid):
                # Read without waiting for the engine thread: a paused request's tokens change only
                # by resume(), which the holder of the request calls after this check, and a
                # request that leaves meanwhile reads as None. Waiting for the loop cost each
                # session turn one more step boundary before it could resume (up to a long
                # prefill step).
                return Answered(self.engine.paused_token_ids(rid))
            case ExpectResume(request_id=rid, after_s=after_s):
                return self.run_sync(lambda engine: engine.expect_resume(rid, after_s))
            case Abandon(request_id=rid):
                return self.run_sync(lambda engine: engine.abandon(rid))
            case GetStats():
                return self.run_sync(LLMEngine.stats)
        raise TypeError(f"not an engine call: {op!r}")

    def _abort_on_close(self, request_id: str) -> None:
        """A stream left early: its request goes (streams.consume skips detached ones)."""
        self.call(Abort(request_id))

    def load_report(self) -> LoadReport:
        """The queues and KV pool now, read without waiting for the engine thread (a routing hint)."""
        return self.engine.load_report()

    def forget_program(self, program_id: str) -> None:
        """A program or session ended. One engine keeps no placement for it (its KV goes with its
        requests); the method exists so the server treats an EnginePool the same way."""
        del program_id

    # ---- lifetime ------------------------------------------------------------------------
    def _check_alive(self) -> None:
        if self.engine_thread.dead is not None:
            raise EngineDeadError(f"the engine loop died: {self.engine_thread.dead!r}")
        if self._closing or self.engine_thread.stopped:
            raise EngineDeadError("the engine is shut down")

    @property
    def is_running(self) -> bool:
        return self.engine_thread.is_running and not self._closing

    async def shutdown(self, drain_timeout: float = 0.0) -> None:
        """Stop the loop; requests still running after `drain_timeout` seconds are aborted."""
        self._closing = True
        deadline = asyncio.get_running_loop().time() + drain_timeout
        while self.streams and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.05)
        for rid in self.streams.request_ids():
            self.call(Abort(rid))
        self.engine_thread.stop()
        await asyncio.get_running_loop().run_in_executor(None, self.engine_thread.thread.join, 10)

    @property
    def num_unfinished_requests(self) -> int:
        return len(self.streams)

    def run_sync(self, fn: Callable[[LLMEngine], object]) -> "asyncio.Future":
        """Run fn(engine) on the loop thread between steps. Not part of EngineClient: for tests,
        benchmarks and invariant checks that look inside one engine."""
        self._check_alive()
        return self.engine_thread.call(fn)
