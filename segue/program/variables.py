"""Semantic variables (Parrot §4.1): named values that connect calls, held on the server.

A variable is either set by the client or produced by exactly one call; its value is a future that
consumers wait on without any client round trip. A failed producer sets the error instead, and the
error travels to every variable downstream, so whoever gets a final output learns which step
failed and why.
"""
from __future__ import annotations

import asyncio
import enum
import uuid
from dataclasses import dataclass, field


class Criteria(str, enum.Enum):
    """What the client optimizes when it gets a variable (Parrot's performance criteria)."""
    LATENCY = "latency"
    THROUGHPUT = "throughput"


class VariableState(str, enum.Enum):
    PENDING = "pending"
    READY = "ready"
    FAILED = "failed"


class VariableError(RuntimeError):
    """A variable could not be produced; `step` names the call that failed first."""

    def __init__(self, message: str, step: str | None = None) -> None:
        super().__init__(message)
        self.step = step


@dataclass(eq=False)
class SemanticVariable:
    owner: str | None
    program_id: str
    name: str
    id: str = field(default_factory=lambda: f"var-{uuid.uuid4().hex}")
    # The call that writes it; None for variables the client sets.
    producer: str | None = None
    consumers: list[str] = field(default_factory=list)
    # The strongest criteria any get has asked for (latency beats throughput).
    criteria: Criteria | None = None
    _value: str | None = None
    _error: VariableError | None = None
    _done: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def state(self) -> VariableState:
        if self._error is not None:
            return VariableState.FAILED
        return VariableState.READY if self._value is not None else VariableState.PENDING

    @property
    def is_done(self) -> bool:
        return self._done.is_set()

    @property
    def value(self) -> str | None:
        return self._value

    @property
    def error(self) -> VariableError | None:
        return self._error

    def set(self, value: str) -> None:
        if self.is_done:
            raise ValueError(f"variable {self.name!r} already has a value")
        self._value = value
        self._done.set()

    def fail(self, error: VariableError) -> None:
        if not self.is_done:
            self._error = error
            self._done.set()

    def mark(self, criteria: Criteria) -> bool:
        """Record a get's criteria; True if this changed what the variable asks for."""
        if self.criteria is Criteria.LATENCY or self.criteria is criteria:
            return False
        self.criteria = criteria
        return True

    async def wait(self, timeout: float | None = None) -> bool:
        """True once the variable is set or failed; False if the timeout passed first."""
        if timeout is not None and timeout <= 0:
            return self.is_done
        try:
            await asyncio.wait_for(self._done.wait(), timeout)
        except asyncio.TimeoutError:
            return False
        return True

    async def get(self, timeout: float | None = None) -> str:
        if not await self.wait(timeout):
            raise asyncio.TimeoutError(f"variable {self.name!r} is not ready yet")
        if self._error is not None:
            raise self._error
        assert self._value is not None
        return self._value
