"""Skip-join multi-level feedback queue (FastServe §4.1) with ENST-ordered KV eviction and an
arrival reserve (§4.2).

Queue k has quantum q_k = base * 2**k. An arriving request skips the queues whose quantum is
shorter than its first iteration (the prefill, priced by the profiled T_fwd), so a long prompt
cannot block short ones the way it does in a plain MLFQ. Service is counted in iteration time;
a request that used up its queue's quantum drops to the first lower queue whose quantum covers
its next iteration. A request that waited `starvation_limit_s` without service goes back to the
top queue. Within a queue, FIFO by the time the request entered it.

Options (`scheduler.policy_options`):
  num_queues           number of queues (default 12; the last one never demotes)
  base_quantum_s       q_0 (default: T_fwd of a one-token decode step, the minimum iteration time)
  starvation_limit_s   waiting time without service before promotion to q_0 (default 1.0; FastServe
                       derives it from the latency SLO)
  skip_join            False joins every arrival to q_0: the original MLFQ, for ablations (default True)
  reserve_window_s     device KV kept free for arrivals: the prompt tokens that arrived in the last
                       this-many seconds (default 1.0; 0 disables the reserve)
  max_reserve_fraction cap on that reserve as a fraction of the device pool (default 0.25)
  decode_share         share of a step's token budget a higher-priority prefill chunk leaves to
                       the decodes of requests holding KV (default 0.5; 0: strict priority, the
                       best TTFT but demoted decodes idle while prompts are prefilled)
"""
from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any, ClassVar

from segue.request import Request
from segue.sched.policies.base import PolicyContext, SchedulingPolicy
from segue.sched.request_queue import RequestQueue

_EPS = 1e-9
_RECOUNT_STEPS = 1024


@dataclass
class MLFQOptions:
    num_queues: int = 12
    base_quantum_s: float | None = None
    starvation_limit_s: float = 1.0
    skip_join: bool = True
    reserve_window_s: float = 1.0
    max_reserve_fraction: float = 0.25
    decode_share: float = 0.5

    @classmethod
    def from_dict(cls, options: dict[str, Any]) -> "MLFQOptions":
        unknown = set(options) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(f"unknown mlfq options {sorted(unknown)}; known: {sorted(cls.__dataclass_fields__)}")
        opts = cls(**options)
        if opts.num_queues < 1:
            raise ValueError("mlfq num_queues must be >= 1")
        if opts.base_quantum_s is not None and opts.base_quantum_s <= 0:
            raise ValueError("mlfq base_quantum_s must be positive")
        if opts.starvation_limit_s <= 0 or opts.reserve_window_s < 0:
            raise ValueError("mlfq starvation_limit_s must be positive and reserve_window_s >= 0")
        if not 0 <= opts.max_reserve_fraction < 1:
            raise ValueError("mlfq max_reserve_fraction must be in [0, 1)")
        if not 0 <= opts.decode_share <= 1:
            raise ValueError("mlfq decode_share must be in [0, 1]")
        return opts


@dataclass
class QueueEntry:
    """Where one request sits in the MLFQ."""
    request_id: str
    level: int
    # FIFO position inside the queue: a counter taken when the request entered it.
    ticket: int
    # Iteration time received since entering this queue.
    attained_s: float
    last_served: float
    paused: bool = False
    # Arrival order: requests promoted in the same step take their tickets in it.
    arrival: int = 0


class MLFQPolicy(SchedulingPolicy):
    name = "mlfq"
    preemptive: ClassVar[bool] = True

    def __init__(self, context: PolicyContext | None = None) -> None:
        super().__init__(context)
        self.options = MLFQOptions.from_dict(dict(self.context.options))
        self.decode_share = self.options.decode_share
        base = self.options.base_quantum_s or self.context.cost.t_fwd(1)
        self.quanta = [base * 2**k for k in range(self.options.num_queues)]
        # prefix[k] = q_0 + ... + q_{k-1}: the service a request has received on reaching queue k.
        self._prefix = [0.0]
        for q in self.quanta:
            self._prefix.append(self._prefix[-1] + q)
        self.entries: dict[str, QueueEntry] = {}
        # Per queue, its request ids in ticket order (tickets only grow, so entering a queue is
        # an append): walking them is the key order, with no key computed or compared.
        self._queues: list[dict[str, None]] = [{} for _ in self.quanta]
        # Per queue, over the requests not paused: how many, and the sum of prefix[k] + attained
        # (where they stand). ENST needs both for every eviction decision; the hooks keep them
        # current (recounted every _RECOUNT_STEPS steps, so float updates never drift).
        self._count = [0] * len(self.quanta)
        self._standing = [0.0] * len(self.quanta)
        self._tickets = 0
        self._steps = 0
        # (last_served, request id) of every service, oldest first: on_step pops the requests
        # that starved instead of scanning all of them. An item is stale once its request was
        # served again, paused or left.
        self._service_times: list[tuple[float, str]] = []
        # Requests served in the previous step: the batch size B of FastServe's ENST.
        self._served_this_step = 0
        self._batch_size = 1
        self._arrivals: deque[tuple[float, int]] = deque()

    # ---- queue placement -----------------------------------------------------------------
    def level_for(self, iteration_s: float, at_least: int = 0) -> int:
        """The highest queue at or below `at_least` whose quantum covers one iteration."""
        for k in range(at_least, len(self.quanta)):
            if self.quanta[k] + _EPS >= iteration_s:
                return k
        return len(self.quanta) - 1

    def _enter(self, entry: QueueEntry, level: int) -> None:
        self._tally(entry, -1)
        del self._queues[entry.level][entry.request_id]
        entry.level, entry.attained_s, entry.ticket = level, 0.0, self._take_ticket()
        self._queues[level][entry.request_id] = None
        self._tally(entry, +1)

    def _take_ticket(self) -> int:
        self._tickets += 1
        return self._tickets - 1

    def _tally(self, entry: QueueEntry, sign: int) -> None:
        """Add (+1) or remove (-1) an entry's share of the per-queue ENST sums."""
        if not entry.paused:
            k = entry.level
            self._count[k] += sign
            # An empty queue stands at exactly 0: a rounding residue would break ENST's ties at 0.
            if self._count[k]:
                self._standing[k] += sign * (self._prefix[k] + entry.attained_s)
            else:
                self._standing[k] = 0.0

    def _recount(self) -> None:
        count, standing = [0] * len(self.quanta), [0.0] * len(self.quanta)
        for entry in self.entries.values():
            if not entry.paused:
                count[entry.level] += 1
                standing[entry.level] += self._prefix[entry.level] + entry.attained_s
        self._count, self._standing = count, standing

    def _mark_served(self, entry: QueueEntry, now: float) -> None:
        entry.last_served = now
        heapq.heappush(self._service_times, (now, entry.request_id))

    def on_arrival(self, request: Request, now: float) -> None:
        prefill = request.num_tokens - request.num_computed_tokens
        level = self.level_for(self.context.cost.t_fwd(prefill)) if self.options.skip_join else 0
        ticket = self._take_ticket()
        entry = QueueEntry(request.request_id, level, ticket, 0.0, now, arrival=ticket)
        self.entries[request.request_id] = entry
        self._queues[level][request.request_id] = None
        self._tally(entry, +1)
        self._mark_served(entry, now)
        self._arrivals.append((now, request.num_prompt_tokens))

    def key(self, request: Request, now: float) -> tuple[int, int, int]:
        entry = self.entries.get(request.request_id)
        if entry is None:  # never announced: behind everything known, FCFS among themselves
            return (len(self.quanta), 0, request.seq_no)
        return (entry.level, entry.ticket, request.seq_no)

    def order(self, requests: Iterable[Request], now: float) -> Iterable[Request]:
        """Key order by walking the queues, lazily: each request costs a lookup, no key."""
        if not isinstance(requests, RequestQueue) or len(requests) * 4 < len(self.entries):
            return super().order(requests, now)
        return self._walk(requests)

    def _walk(self, queue: RequestQueue) -> Iterator[Request]:
        for level in self._queues:
            for rid in level:
                req = queue.get(rid)
                if req is not None:
                    yield req
        # Never announced to the policy: behind everything known, FCFS among themselves.
        yield from sorted((r for r in queue if r.request_id not in self.entries), key=lambda r: r.seq_no)

    # ---- service, demotion, promotion ----------------------------------------------------
    def on_step(self, now: float) -> None:
        self._batch_size = max(1, self._served_this_step)
        self._served_this_step = 0
        limit, times = self.options.starvation_limit_s, self._service_times
        starved: dict[str, QueueEntry] = {}
        while times and now - times[0][0] >= limit - _EPS:
            served, rid = heapq.heappop(times)
            entry = self.entries.get(rid)
            if entry is not None and entry.last_served == served and entry.level > 0 and not entry.paused:
                starved[rid] = entry
        for entry in sorted(starved.values(), key=lambda e: e.arrival):
            self._enter(entry, 0)
            self._mark_served(entry, now)
        self._steps += 1
        if self._steps % _RECOUNT_STEPS == 0:
            self._recount()

    def on_scheduled(self, request: Request, num_tokens: int, now: float) -> None:
        entry = self.entries.get(request.request_id)
        if entry is None:
            return
        self._served_this_step += 1
        self._mark_served(entry, now)
        # Rebuilding a discarded or evicted context is not service: charging it would demote a
        # request halfway through its recompute and make it the next eviction victim.
        start = request.num_computed_tokens
        fresh = num_tokens - max(0, min(request.max_computed_tokens, start + num_tokens) - start)
        if fresh <= 0:
            return
        cost = self.context.cost
        served = cost.t_fwd(fresh)
        entry.attained_s += served
        if not entry.paused:
            self._standing[entry.level] += served
        if entry.attained_s + _EPS < self.quanta[entry.level] or entry.level == len(self.quanta) - 1:
            return
        # Called before the step's tokens count as computed: what is left after it is either
        # the rest of a chunked prefill or one decode token.
        rest = request.num_tokens - request.num_computed_tokens - num_tokens
        next_s = cost.t_fwd(rest if rest > 0 else 1)
        self._enter(entry, self.level_for(next_s, entry.level + 1))

    def on_intercepted(self, request: Request, now: float) -> None:
        entry = self.entries.get(request.request_id)
        if entry is not None and not entry.paused:
            self._tally(entry, -1)
            entry.paused = True

    def on_resumed(self, request: Request, now: float) -> None:
        entry = self.entries.get(request.request_id)
        if entry is not None:
            # The tool time is not starvation: the wait for service starts now.
            if entry.paused:
                entry.paused = False
                self._tally(entry, +1)
            self._mark_served(entry, now)

    def on_finished(self, request: Request, now: float) -> None:
        entry = self.entries.pop(request.request_id, None)
        if entry is not None:
            self._tally(entry, -1)
            del self._queues[entry.level][request.request_id]

    # ---- proactive KV management (§4.2) --------------------------------------------------
    def enst(self, requests: list[Request], now: float) -> dict[str, float]:
        """Estimated next scheduled time, seconds from now: min(T_promote, T_execute), where
        T_execute assumes every request in a higher queue runs down to this one's queue before
        this one runs, B at a time."""
        n, prefix = len(self.quanta), self._prefix
        out = {}
        ahead_count, ahead_start = 0, 0.0
        by_level = [(0, 0.0)] * n
        for k in range(n):
            by_level[k] = (ahead_count, ahead_start)
            ahead_count += self._count[k]
            ahead_start += self._standing[k]
        for req in requests:
            entry = self.entries.get(req.request_id)
            if entry is None:
                out[req.request_id] = math.inf
                continue
            m, s = by_level[entry.level]
            t_execute = (m * prefix[entry.level] - s) / self._batch_size
            t_promote = max(0.0, self.options.starvation_limit_s - (now - entry.last_served))
            out[req.request_id] = min(t_promote, max(0.0, t_execute))
        return out

    def preemption_order(self, requests: list[Request], now: float) -> list[Request]:
        """Largest ENST first; among equal estimates, the one further back in the queues."""
        enst = self.enst(requests, now)
        return sorted(requests, key=lambda r: (enst[r.request_id], self.key(r, now)), reverse=True)

    def reserved_blocks(self, now: float) -> int:
        """Blocks for the prompts that arrived in the last reserve window: bursts raise it."""
        window = self.options.reserve_window_s
        while self._arrivals and self._arrivals[0][0] < now - window:
            self._arrivals.popleft()
        if window <= 0:
            return 0
        tokens = sum(t for _, t in self._arrivals)
        tokens = min(tokens, int(self.options.max_reserve_fraction * self.context.kv_capacity_tokens))
        return -(-tokens // self.context.block_size)
