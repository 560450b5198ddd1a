"""The one interface every ordering policy implements."""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, ClassVar

from segue.request import Request


class SchedulingPolicy(ABC):
    """Orders requests: the scheduler serves running and waiting requests in ascending key
    order and preempts the running request with the largest key when memory runs out."""

    name: ClassVar[str]

    @abstractmethod
    def key(self, request: Request, now: float) -> Any:
        ...

    def on_scheduled(self, request: Request, num_tokens: int, now: float) -> None:
        """Called for each request that ran this step (stateful policies track service)."""

    def on_finished(self, request: Request, now: float) -> None:
        """Called once when a request leaves the system."""
