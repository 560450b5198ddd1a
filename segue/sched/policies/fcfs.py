"""First come, first served: vLLM's order, the baseline every other policy is measured against."""
from __future__ import annotations

from segue.request import Request
from segue.sched.policies.base import SchedulingPolicy


class FCFSPolicy(SchedulingPolicy):
    name = "fcfs"

    def key(self, request: Request, now: float) -> tuple[float, int]:
        return (request.sched_arrival_time, request.seq_no)
