"""Placing requests on engine replicas: the Router interface and the load bookkeeping it shares.

A router sees each new request once (its prompt tokens and hints) and names the replica that runs
it. Everything that later concerns the request (continue, resume, abort) follows the request id to
the same replica; that mapping belongs to the pool, not the router. The router is pure Python and
never calls a replica: replicas report their load (LoadReport) with their outputs, and the pool
tells the router when a request's first output arrived (from then on the report counts it) and
when it is gone.
"""
from __future__ import annotations

import abc
import enum
from collections import Counter
from dataclasses import dataclass, field
from typing import Sequence

from segue.engine.stats import LoadReport  # what replicas report; an engine's own type (engine/stats.py)


class PlacementReason(str, enum.Enum):
    AFFINITY = "affinity"        # the request's program (session) already lives on the replica
    TASK_GROUP = "task_group"    # a call of the same task group was placed there
    PREFIX = "prefix"            # the replica served a prompt with the same leading blocks
    LOAD = "load"                # no locality to keep: the least loaded replica
    ROUND_ROBIN = "round_robin"  # the baseline router


@dataclass(frozen=True)
class RouteRequest:
    request_id: str
    prompt_token_ids: Sequence[int]
    program_id: str | None = None
    task_group: str | None = None
    # Requests with different salts never share cached blocks in the engine, so they share no prefix here.
    cache_salt: str | None = None


@dataclass(frozen=True)
class RouteDecision:
    replica: int
    reason: PlacementReason
    # Leading full prompt blocks the router believes the replica has cached (0: none known).
    prefix_blocks: int = 0


@dataclass
class _ReplicaLoad:
    report: LoadReport = field(default_factory=LoadReport)
    # Routed here but not yet seen in a report (no output back yet): a burst of arrivals between two
    # reports must not all pick the same "idle" replica.
    unconfirmed: int = 0
    available: bool = True


class Router(abc.ABC):
    name = "router"

    def __init__(self, num_replicas: int) -> None:
        if num_replicas < 1:
            raise ValueError(f"a router needs at least one replica, got {num_replicas}")
        self.num_replicas = num_replicas
        self._loads = [_ReplicaLoad() for _ in range(num_replicas)]
        self._unconfirmed: dict[str, int] = {}
        self.placements: Counter[PlacementReason] = Counter()

    # ---- the interface -------------------------------------------------------------------
    @abc.abstractmethod
    def _place(self, request: RouteRequest, candidates: list[int]) -> RouteDecision:
        """Pick one of `candidates` (available replicas, never empty) and remember what locality
        the choice creates."""

    def forget_program(self, program_id: str) -> None:  # noqa: B027 -- optional hook: a no-op by default
        """The program (session) ended: its calls no longer need to stay together."""

    # ---- shared bookkeeping --------------------------------------------------------------
    def route(self, request: RouteRequest) -> RouteDecision:
        candidates = [i for i, load in enumerate(self._loads) if load.available]
        if not candidates:
            raise RuntimeError("no engine replica is available")
        decision = self._place(request, candidates)
        self.placements[decision.reason] += 1
        self._loads[decision.replica].unconfirmed += 1
        self._unconfirmed[request.request_id] = decision.replica
        return decision

    def confirm(self, request_id: str) -> None:
        """The request's replica answered (or it failed before): reports count it from now on."""
        replica = self._unconfirmed.pop(request_id, None)
        if replica is not None:
            self._loads[replica].unconfirmed -= 1

    def report_load(self, replica: int, report: LoadReport) -> None:
        self._loads[replica].report = report

    def set_available(self, replica: int, available: bool) -> None:
        self._loads[replica].available = available

    def forget_replica(self, replica: int) -> None:
        """The replica's engine was rebuilt: nothing it cached or held is there any more."""
        self._loads[replica].report = LoadReport()

    def is_available(self, replica: int) -> bool:
        return self._loads[replica].available

    def load(self, replica: int) -> int:
        """Requests running or queued on the replica, as far as the router knows."""
        state = self._loads[replica]
        return state.report.queued + state.unconfirmed

    def least_loaded(self, candidates: list[int]) -> int:
        # Ties go to the lower index, so an idle pool fills replica 0 first and tests are deterministic.
        return min(candidates, key=lambda i: (self.load(i), i))

    def loads(self) -> list[int]:
        return [self.load(i) for i in range(self.num_replicas)]

