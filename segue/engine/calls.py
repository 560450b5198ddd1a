"""EngineCall: what a caller asks of an engine's requests, as one typed value.

The questions and hints about a request (abort it, the tokens it holds while paused, when it is
expected back, nobody will continue it) and the engine's stats snapshot cross every layer between
the server and the engine's requests: the EngineClient (engine/protocol.py), the pool, a replica,
a Ray actor. Each layer has one method for them all, `call(op)`, and decides only where the call
goes (which replica, which thread); AsyncLLMEngine.call is the one place that says what each call
does to the engine. A new question is a new class here, not a method on every layer.

Each call's type parameter is its answer: `await engine.call(Abandon(rid))` is a bool. Calls and
answers are frozen dataclasses and plain data, so they pickle into a Ray actor and back.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Generator, Generic, TypeVar

from segue.engine.stats import EngineStats

R = TypeVar("R")


@dataclass(frozen=True)
class EngineCall(Generic[R]):
    """A call whose answer is an R."""


@dataclass(frozen=True)
class RequestCall(EngineCall[R]):
    """A call about one request; it goes to whichever replica holds that request."""
    request_id: str

    def answer_if_absent(self) -> R:
        """The answer when no engine holds the request (finished, aborted, never placed, or its
        replica restarted): a pool answers it without asking any replica."""
        raise NotImplementedError


@dataclass(frozen=True)
class Abort(RequestCall[None]):
    """End the request and free what it holds (idempotent). Fire-and-forget: call() sends it at
    once and its answer is ready at once, so code that must not wait (a closing stream, a session
    dropping its held turn) sends it without awaiting."""

    def answer_if_absent(self) -> None:
        return None


@dataclass(frozen=True)
class HeldTokens(RequestCall[list[int] | None]):
    """The token ids a paused request holds (what a continuation extends); None if it is not
    paused (finished, aborted, or its engine restarted)."""

    def answer_if_absent(self) -> list[int] | None:
        return None


@dataclass(frozen=True)
class ExpectResume(RequestCall[bool]):
    """A caller's estimate of a pause: resumed `after_s` seconds after it began (math.inf: never).
    The interception policy and block eviction use it. False if the request is not paused."""
    after_s: float

    def answer_if_absent(self) -> bool:
        return False


@dataclass(frozen=True)
class Abandon(RequestCall[bool]):
    """Nobody is expected to continue this paused request soon: its device memory goes back to the
    pool, its blocks stay findable in the prefix cache. False if it is not paused."""

    def answer_if_absent(self) -> bool:
        return False


@dataclass(frozen=True)
class GetStats(EngineCall[EngineStats]):
    """A snapshot between steps (a pool's is the merge of its live replicas', EngineStats.merge)."""


class Answered(Generic[R]):
    """An awaitable whose answer is already known (an Abort's, a pool's answer for a request no
    replica holds). Unlike a coroutine it needs no event loop and warns nobody if never awaited."""

    def __init__(self, value: R) -> None:
        self.value = value

    def __await__(self) -> Generator[Any, None, R]:
        return self.value
        yield  # unreachable: makes __await__ a generator that finishes at once
