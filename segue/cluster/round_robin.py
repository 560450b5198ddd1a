"""The baseline router: replicas in turn, blind to programs, prefixes and load."""
from __future__ import annotations

from segue.cluster.router import PlacementReason, RouteDecision, Router, RouteRequest


class RoundRobinRouter(Router):
    name = "round_robin"

    def __init__(self, num_replicas: int) -> None:
        super().__init__(num_replicas)
        self._next = 0

    def _place(self, request: RouteRequest, candidates: list[int]) -> RouteDecision:
        # The first candidate at or after the cursor, so a dead replica's turn passes to the next.
        later = [i for i in candidates if i >= self._next]
        replica = later[0] if later else candidates[0]
        self._next = (replica + 1) % self.num_replicas
        return RouteDecision(replica, PlacementReason.ROUND_ROBIN)
