"""Admission of waiting requests into a step, in the policy's order, under the token budget and
the device KV pool: one Admission object per step (the shape of SGLang's PrefillAdder), whose
add() answers each candidate with an AddResult. Used by the Scheduler; pure Python.

When the head cannot get memory, a non-preemptive policy stops there (vLLM's head-of-line rule:
the order decides who gets memory first). Under a preemptive policy the waiting list also holds
the requests that lost this step with their KV, so stopping would leave a full pool idle;
instead requests that already hold KV keep running within the free blocks (they hold what the
head waits for, and finishing gives it back). Only when nothing at all can run does the head
take memory from waiting holders by discarding it (they recompute later). Who gives memory to
whom at each of admission's sites: sched/memory_table.py."""
from __future__ import annotations

import enum
from collections.abc import Iterator
from dataclasses import dataclass, field

from segue.kv.interface import NO_HIT, PrefixHit
from segue.request import Request, RequestStatus
from segue.sched.latency_capacity import LatencyCapacity
from segue.sched.memory import free_for_admission, free_for_holder, free_for_idle_step
from segue.sched.memory_kept import hand_over
from segue.sched.newcomers import newcomers_first
from segue.sched.output import SchedulerOutput
from segue.sched.preemption import swap_budget_blocks
from segue.sched.state import SchedulerState
from segue.sched.thrashing import Fit, fit_beside_agents, running_needs, still_needed


class AddResult(enum.Enum):
    """What Admission.add did with one candidate (SGLang's AddReqResult)."""
    ADMITTED = "admitted"            # runs in this step
    SKIPPED = "skipped"              # not this one, but later candidates may still run
    SWAPPING = "swapping"            # its KV is on the way (host-tier hits or swap-outs): a later step
    NO_TOKEN = "no_token"            # the step's token budget or max_num_seqs is spent: stop
    NO_MEMORY = "no_memory"          # a non-preemptive head cannot get memory: stop (head-of-line)
    OVER_CAPACITY = "over_capacity"  # a non-preemptive queue is over the latency capacity: stop

    @property
    def stops(self) -> bool:
        return self in (AddResult.NO_TOKEN, AddResult.NO_MEMORY, AddResult.OVER_CAPACITY)


@dataclass
class _Blocked:
    """The first request that could not get memory this step, and what it needed (behind it only
    requests that already hold KV run; if nothing runs at all, it takes memory by a discard)."""
    request: Request
    num_new: int
    hit: PrefixHit = NO_HIT
    need: int = 0
    swapping: bool = False  # lower-ranked holders are being swapped out for it (sched/memory.py)


@dataclass
class Admission:
    """One step's admission. Its budget is explicit: `budget` tokens left in the step,
    `decode_room` of them kept for resident decodes, `watermark_blocks` device blocks a newcomer
    must leave free while others run, the device pool's free blocks (the KV manager's count,
    read at each decision: admissions and releases change it), and the latency capacity."""
    sched: SchedulerState
    out: SchedulerOutput
    budget: int
    scheduled: list[tuple[Request, int]]
    preemptive: bool = field(init=False)
    decode_room: int = field(init=False, default=0)
    watermark_blocks: int = field(init=False)
    capacity: LatencyCapacity | None = field(init=False)
    blocked: _Blocked | None = field(init=False, default=None)
    # Thrashing avoidance (sched.agents on, non-preemptive orders): device blocks that admitted
    # requests will still need (sched/thrashing.py); None when off.
    committed: int | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        sched = self.sched
        self.preemptive = sched.policy.preemptive
        # Preemptive policies: the decodes of requests that hold their KV cost one token each and
        # nothing in memory, so a higher-priority prefill chunk is trimmed to leave them room (up
        # to the policy's decode_share of the budget) instead of taking the whole step. Without
        # it a top-queue prompt idles every demoted decode for a step per chunk (simulator, chat
        # mix: mean end-to-end latency 27% above FCFS's; with half the budget, 6% below).
        if self.preemptive:
            self.decode_room = _count_resident_decodes(sched, int(self.budget * sched.policy.decode_share))
        self.watermark_blocks = int(sched.config.watermark * sched.kv.counters().num_blocks)
        self.capacity = LatencyCapacity.of(sched)
        if sched.agents is not None and not self.preemptive:
            # Preemptive orders admit into a full pool on purpose: their head takes memory from
            # lower-ranked holders (sched/memory.py), which a whole-prompt test would never let it reach.
            self.committed = running_needs(sched)
            # Resumed requests waiting to swap in go before newcomers: their host parts are spoken for.
            self.committed += sum(sched.kv.held(r.request_id).host for r in sched.paused.swapped)

    @property
    def free_blocks(self) -> int:
        return self.sched.kv.counters().num_free_blocks

    def headroom(self, req: Request) -> int:
        """Blocks a request without KV must leave free when others run: admitting requests until
        the pool is exactly full makes the next step's decodes preempt (and recompute) someone."""
        others = self.scheduled or self.sched.running
        return self.watermark_blocks if others and not self.sched.kv.held(req.request_id).device else 0

    def allocate(self, req: Request, num_new: int, hit: PrefixHit) -> bool:
        # num_new excludes the cached hits, so this counts the fresh blocks only; without a
        # headroom, allocate_slots's own check is the whole test.
        room = self.headroom(req)
        if room and self.sched.kv.num_blocks_needed(req, num_new) + room > self.free_blocks:
            return False
        return self.sched.kv.allocate_slots(req, num_new, hit)

    def candidates(self) -> Iterator[Request]:
        """The waiting requests in the policy's order, read no further than admission goes."""
        sched, seen = self.sched, set()
        ordered = sched.policy.order(sched.waiting, sched.now)
        if self.committed is not None:
            # Thrashing avoidance holds newcomers back for running agents; past the newcomer bound
            # they go ahead of the later turns sent after them.
            ordered = newcomers_first(sched, ordered)
        for req in ordered:
            if self.blocked is not None or (self.decode_room > 0 and self.budget <= self.decode_room):
                # Behind a blocked head, or once the budget left is the decodes' share, only
                # requests that already hold KV may run; under overload they are a few among
                # thousands, so they are looked up, not scanned for.
                rest = [r for r in sched.waiting_holders() if r.request_id not in seen]
                yield from sched.policy.order(rest, sched.now)
                return
            seen.add(req.request_id)
            yield req

    def add(self, req: Request) -> AddResult:
        sched = self.sched
        if self.budget <= 0 or len(sched.running) >= sched.config.max_num_seqs:
            return AddResult.NO_TOKEN
        if req.status == RequestStatus.SWAPPED:
            return AddResult.SKIPPED  # swapped out for the blocked head
        if self.blocked is not None and not sched.kv.held(req.request_id).device:
            return AddResult.SKIPPED
        if self.capacity is not None and not self.capacity.admits(req):
            # Over the latency capacity, a non-preemptive queue waits in order (Parrot's FIFO).
            return AddResult.SKIPPED if self.preemptive else AddResult.OVER_CAPACITY
        decode = self.decode_room > 0 and _is_resident_decode(sched, req)
        if self.decode_room > 0 and not decode and self.budget <= self.decode_room:
            return AddResult.SKIPPED  # no room for another chunk in this step
        hit = NO_HIT
        if req.num_computed_tokens == 0:
            hit = sched.kv.match(req)
            holds_kv = sched.kv.held(req.request_id).device > 0
            if self.committed is not None and self.blocked is None and not holds_kv:
                alone = not (self.scheduled or sched.running)
                fit = fit_beside_agents(sched, req, hit, self.committed, alone)
                if fit is not Fit.FITS:
                    # A starving head keeps the memory that frees up for itself (head-of-line)
                    # where the order allows it; preemptive orders put it first on their own.
                    starving = fit is Fit.STARVES
                    return AddResult.NO_MEMORY if starving and not self.preemptive else AddResult.SKIPPED
            if self.blocked is None and load_host_hits(sched, req, hit, self.out):
                if self.committed is not None:
                    self.committed += still_needed(self.sched, req)
                return AddResult.SWAPPING
        elif self.committed is not None and self.blocked is None:
            # A held context resumed (a session's next turn): the same test, or its appended
            # tokens and output grow into a preemption (pressure preset, sessions: 50-80 a run).
            fit = fit_beside_agents(sched, req, NO_HIT, self.committed, not (self.scheduled or sched.running))
            if fit is not Fit.FITS:
                return AddResult.NO_MEMORY if fit is Fit.STARVES else AddResult.SKIPPED
        num_new = min(req.num_tokens - req.num_computed_tokens - hit.num_tokens, self.budget)
        if self.decode_room > 0 and not decode:
            num_new = min(num_new, self.budget - self.decode_room)
        if not self.allocate(req, num_new, hit):
            result = self._make_room(req, num_new, hit)
            if result is not None:
                return result
        self._take(req, num_new, hit.num_tokens, decode)
        return AddResult.ADMITTED

    def _make_room(self, req: Request, num_new: int, hit: PrefixHit) -> AddResult | None:
        """Free memory for a request that did not fit (sched/memory.py); None when it now has its blocks."""
        sched = self.sched
        if self.blocked is not None:
            # Behind the blocked head, a holder that cannot grow takes the blocks from holders
            # that rank below it: with every holder stuck, a full pool would run nothing.
            if self.preemptive and free_for_holder(sched, req, num_new, self.out) and self.allocate(req, num_new, hit):
                return None
            return AddResult.SKIPPED
        # The free blocks it takes: fresh blocks for its new tokens (num_blocks_needed counts
        # from its computed tokens, so its hits are not in it) and the hits that sit in the free
        # list. Not the watermark: discarding paused contexts to keep headroom defeats the
        # headroom (measured: more recompute).
        need = sched.kv.num_blocks_needed(req, num_new) + hit.num_free()
        room = free_for_admission(sched, req, need, not (self.scheduled or sched.running), self.out)
        self.blocked = _Blocked(req, num_new, hit, need, swapping=room.in_flight)
        if room.in_flight:
            return AddResult.SWAPPING  # swap-outs free the memory by the next step
        if not (room.gave and self.allocate(req, num_new, hit)):
            return AddResult.SKIPPED if self.preemptive else AddResult.NO_MEMORY
        self.blocked = None
        return None

    def _take(self, req: Request, num_new: int, num_hit: int, decode: bool = False) -> None:
        _admit(self.sched, req, num_new, num_hit, self.scheduled)
        if self.committed is not None:
            self.committed += still_needed(self.sched, req)
        if self.capacity is not None:
            self.capacity.add(req)
        self.budget -= num_new
        if decode:
            self.decode_room -= 1

    def finish(self) -> int:
        """End of the step's admission; returns the token budget left."""
        b = self.blocked
        if self.preemptive and b is not None and not b.swapping and not self.scheduled:
            # Nothing ran: without a discard, nothing would ever free memory.
            if free_for_idle_step(self.sched, b.request, b.need) and self.allocate(b.request, b.num_new, b.hit):
                _admit(self.sched, b.request, b.num_new, b.hit.num_tokens, self.scheduled)
                self.budget -= b.num_new
        return self.budget


def admit_waiting(sched: SchedulerState, out: SchedulerOutput, budget: int,
                  scheduled: list[tuple[Request, int]]) -> int:
    """Admit waiting requests in key order until the budget, max_num_seqs or memory runs out;
    appends to `scheduled` and returns the budget left."""
    admission = Admission(sched, out, budget, scheduled)
    for req in admission.candidates():
        if admission.add(req).stops:
            break
    return admission.finish()


def _admit(sched: SchedulerState, req: Request, num_new: int, num_hit: int,
           scheduled: list[tuple[Request, int]]) -> None:
    if req.num_cached_tokens < 0:
        req.num_cached_tokens = num_hit
        sched.prefix_hit_tokens += num_hit
        sched.prefix_query_tokens += req.num_prompt_tokens
    req.num_computed_tokens += num_hit
    hand_over(sched, req)
    sched.waiting.remove(req)
    req.status = RequestStatus.RUNNING
    sched.running.append(req)
    scheduled.append((req, num_new))


def _count_resident_decodes(sched: SchedulerState, limit: int) -> int:
    """How many waiting requests are resident decodes, counting no further than `limit`."""
    count = 0
    for req in sched.waiting_holders():
        if count >= limit:
            break
        count += _is_resident_decode(sched, req)
    return count


def _is_resident_decode(sched: SchedulerState, req: Request) -> bool:
    # Cheapest test first: under overload most waiting requests have computed nothing.
    return (req.num_computed_tokens > 0 and req.status != RequestStatus.SWAPPED
            and req.num_tokens - req.num_computed_tokens == 1 and sched.kv.held(req.request_id).device > 0)


def load_host_hits(sched: SchedulerState, req: Request, device_hit: PrefixHit, out: SchedulerOutput) -> bool:
    """A request whose prefix goes on past its device hits into the host tier takes those
    host blocks and swaps them in like a resumed swapped-out request (the first chunk now,
    the rest within later steps' swap limits, before it runs) instead of recomputing them.
    Only when this step can start the copy (a step that only queued it would look idle) and
    the device has room for the whole host part now: a load started into a nearly full pool
    holds its first blocks for steps while the running requests' growth preempts others
    (simulator, Mooncake conversation trace at gptj-6b-a100, reuse-keyed eviction: mean TTFT
    36.7 s without this rule, 33.7 s with it; LRU 34.0 and 33.9 s; BENCHMARKS.md).
    True if it did."""
    hit = sched.kv.match_host(req, device_hit)
    if not hit.num_host_blocks:
        return False
    budget = swap_budget_blocks(sched)
    free = sched.kv.counters().num_free_blocks - hit.num_free()
    if budget <= 0 or free < hit.num_host_blocks:
        return False
    sched.kv.attach_host_hit(req, hit)
    hand_over(sched, req)
    if req.num_cached_tokens < 0:
        req.num_cached_tokens = req.num_computed_tokens
        sched.prefix_hit_tokens += req.num_computed_tokens
        sched.prefix_query_tokens += req.num_prompt_tokens
    sched.waiting.remove(req)
    out.blocks_to_swap_in += sched.paused.begin_swap_in(req, budget)
    return True
