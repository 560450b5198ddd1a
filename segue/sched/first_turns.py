"""The first turns that have not produced a token yet, in arrival order: where the newcomer bound
(sched/newcomers.py) finds the newcomers past it without reading the waiting queue. Pure Python.

Under overload the waiting queue holds thousands of requests; admission reads it lazily, in the
policy's order, and stops where the step is full. Finding the overdue newcomers by scanning that
queue (and sorting them) would read all of it every step; this index holds them in arrival order,
so the overdue ones are its front and a step reads only as far as it moves some of them.

Entries are not removed one by one (a request's first token is produced in several places): a
finished request or one that has a token is skipped where it is met, and the list is rebuilt
without them once it has doubled since the last rebuild, so it stays within twice what is live.
"""
from __future__ import annotations

import bisect
from collections.abc import Iterator

from segue.request import Request

# Rebuilds below this size are not worth their pass.
_MIN_COMPACT = 64


def _arrival(req: Request) -> tuple[float, int]:
    return req.arrival_time, req.seq_no


def _pending(req: Request) -> bool:
    """Still a candidate: not finished, no token yet (whether it is waiting is the caller's test)."""
    return not req.is_finished and req.num_generated_tokens == 0


class FirstTurns:
    def __init__(self) -> None:
        self._requests: list[Request] = []   # sorted by arrival (arrival_time, seq_no)
        self._live_at_rebuild = 0

    def add(self, req: Request) -> None:
        # Arrivals come in time order, so this lands at (or near) the end.
        bisect.insort(self._requests, req, key=_arrival)
        if len(self._requests) > 2 * self._live_at_rebuild + _MIN_COMPACT:
            self._requests = [r for r in self._requests if _pending(r)]
            self._live_at_rebuild = len(self._requests)

    def arrived_by(self, t: float) -> Iterator[Request]:
        """The pending ones that arrived at or before `t`, earliest first; lazy."""
        for req in self._requests:
            if req.arrival_time > t:
                return
            if _pending(req):
                yield req

    def __len__(self) -> int:
        """Entries held, skipped ones included (what the rebuild bounds)."""
        return len(self._requests)
