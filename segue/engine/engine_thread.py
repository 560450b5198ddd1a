"""The engine's own thread: it steps an LLMEngine and, between steps, runs what other threads queue.

EngineThread owns the LLMEngine once started: callers never touch engine state directly, they
submit() operations (adds, aborts, resumes, run_sync reads) that the thread applies between
steps, so a long step never blocks an event loop and no lock is held across a forward pass.
Each step's outputs go to their requests' streams (engine/streams.py). A failing step
aborts every request; a failing loop fails every stream and pending operation instead of
hanging them. build_off_caller_thread builds the engine on a short-lived thread, so that only
this thread ever holds OpenMP worker pools.
"""
from __future__ import annotations

import asyncio
import logging
import threading
from collections import deque
from typing import Callable

from segue.engine.llm_engine import LLMEngine
from segue.engine.protocol import EngineDeadError
from segue.engine.streams import OutputStreams

logger = logging.getLogger(__name__)


def build_off_caller_thread(build: Callable[[], LLMEngine]) -> LLMEngine:
    """Builds the engine (model load, kernel table, warm-up) on a thread that then exits.

    OpenMP keeps a pool of worker threads per thread that has run a parallel region, and once
    there are more of them than cores it stops spinning between regions (libgomp's throttled
    spin), which halved single-stream decode when the model was loaded on the server's main
    thread and run on the engine thread (108 vs 60 tok/s measured). A builder thread's pool goes
    when the thread exits, so only the engine thread ever holds one."""
    result: list[LLMEngine] = []
    errors: list[BaseException] = []

    def run() -> None:
        try:
            result.append(build())
        except BaseException as e:  # re-raised on the caller's thread below
            errors.append(e)

    builder = threading.Thread(target=run, name="segue-engine-build")
    builder.start()
    builder.join()
    if errors:
        raise errors[0]
    return result[0]


class EngineThread:
    """Starts at once; stop() ends it after the operations queued before."""

    def __init__(self, engine: LLMEngine, streams: OutputStreams) -> None:
        self.engine = engine
        self.streams = streams
        self._ops: deque[Callable[[], None]] = deque()
        self._wakeup = threading.Event()
        self.stopped = False
        # What killed the loop (a bug in the loop itself); None while it runs or after a clean stop.
        self.dead: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="segue-engine", daemon=True)
        self.thread.start()

    @property
    def is_running(self) -> bool:
        return self.thread.is_alive() and self.dead is None

    def submit(self, op: Callable[[], None]) -> None:
        """Run op() on this thread between steps (from any thread)."""
        self._ops.append(op)
        self._wakeup.set()

    def stop(self) -> None:
        self.submit(self._stop)

    def call(self, fn: Callable[[LLMEngine], object]) -> "asyncio.Future":
        """fn(engine) on this thread between steps; its result or exception on the running event
        loop's future."""
        loop = asyncio.get_running_loop()
        fut = loop.create_future()

        def op() -> None:
            if self.dead is not None:
                # Queued when the loop died: the dead engine's state is no answer (a check made
                # now would report a healthy-looking engine that will never step again).
                loop.call_soon_threadsafe(fut.set_exception, EngineDeadError(f"the engine loop died: {self.dead!r}"))
                return
            try:
                result = fn(self.engine)
            except Exception as e:  # handed to the caller, not swallowed
                loop.call_soon_threadsafe(fut.set_exception, e)
            else:
                loop.call_soon_threadsafe(fut.set_result, result)
        self.submit(op)
        return fut

    # ---- on this thread ------------------------------------------------------------------
    def _stop(self) -> None:
        self.stopped = True

    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as e:  # a bug in the loop itself: fail everyone loudly, never hang
            logger.exception("engine loop died")
            self.dead = e
        finally:
            error = EngineDeadError("the engine stopped") if self.dead is None else EngineDeadError(repr(self.dead))
            for rid in self.streams.request_ids():
                self.streams.deliver(error, rid)
            # Pending run_sync callers and adds are answered too, instead of waiting forever.
            while self._ops:
                try:
                    self._ops.popleft()()
                except Exception:
                    logger.exception("operation failed during engine shutdown")

    def _loop(self) -> None:
        while not self.stopped:
            while self._ops:
                op = self._ops.popleft()
                try:
                    op()
                except Exception:
                    logger.exception("engine operation failed")
            if not self.engine.has_unfinished_requests():
                self._wakeup.wait(timeout=1.0)
                self._wakeup.clear()
                continue
            try:
                outputs = self.engine.step()
            except Exception as e:
                logger.exception("engine step failed; aborting all requests")
                for rid in self.engine.unfinished_request_ids():
                    self.engine.abort_request(rid)
                    self.streams.deliver(e, rid)
                continue
            for out in outputs:
                self.streams.deliver(out)
            if self.engine.last_step_idle:
                # Everything is paused (tools, timers): sleep until an op or the next timer.
                due = self.engine.next_timer()
                timeout = 0.05 if due is None else max(0.0, min(0.05, due - self.engine.clock()))
                self._wakeup.wait(timeout=timeout)
                self._wakeup.clear()
