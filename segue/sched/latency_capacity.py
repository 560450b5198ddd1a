"""Parrot's latency capacity for admission (sched/admission.py). Pure Python."""
from __future__ import annotations

from dataclasses import dataclass

from segue.request import Request
from segue.sched.state import SchedulerState


@dataclass
class LatencyCapacity:
    """Parrot's capacity threshold: the tokens of all running requests' contexts. While any
    latency-sensitive request runs (or would join), admission stays within
    `latency_capacity_tokens`, because each decode step's time grows with the batch's tokens; a
    batch of throughput work alone may fill the pool. A lone request always runs."""
    limit: int
    tokens: int
    latency_running: bool
    count: int

    @classmethod
    def of(cls, sched: SchedulerState) -> LatencyCapacity | None:
        limit = sched.config.latency_capacity_tokens
        if limit is None:
            return None
        return cls(limit, sum(r.num_tokens for r in sched.running),
                   any(r.latency_sensitive for r in sched.running), len(sched.running))

    def admits(self, req: Request) -> bool:
        if self.count == 0 or not (self.latency_running or req.latency_sensitive):
            return True
        return self.tokens + req.num_tokens <= self.limit

    def add(self, req: Request) -> None:
        self.tokens += req.num_tokens
        self.latency_running = self.latency_running or req.latency_sensitive
        self.count += 1
