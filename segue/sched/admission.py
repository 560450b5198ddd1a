"""Admission of waiting requests into a step, in the policy's order, under the token budget and
the device KV pool. Used by the Scheduler; pure Python."""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

from segue.kv.block_pool import KVBlock
from segue.request import Request, RequestStatus
from segue.sched.output import SchedulerOutput
from segue.sched.preemption import Room, holders_below, make_room, swap_budget_blocks
from segue.sched.state import SchedulerState


@dataclass
class _Blocked:
    """The first request that could not get memory this step, and what it needed (behind it only
    requests that already hold KV run; if nothing runs at all, it takes memory by a discard)."""
    request: Request
    num_new: int
    hits: list[KVBlock] = field(default_factory=list)
    need: int = 0
    swapping: bool = False  # make_room started swap-outs for it


def admit_waiting(sched: SchedulerState, out: SchedulerOutput, budget: int,
                  scheduled: list[tuple[Request, int]]) -> int:
    """Admit waiting requests in key order until the budget, max_num_seqs or memory runs out;
    appends to `scheduled` and returns the budget left.

    When the head cannot get memory, a non-preemptive policy stops there (vLLM's head-of-line
    rule: the order decides who gets memory first). Under a preemptive policy the waiting list
    also holds the requests that lost this step with their KV, so stopping would leave a full
    pool idle; instead requests that already hold KV keep running within the free blocks (they
    hold what the head waits for, and finishing gives it back). Only when nothing at all can run
    does the head take memory from waiting holders by discarding it (they recompute later)."""
    preemptive = sched.policy.preemptive
    blocked: _Blocked | None = None
    # Preemptive policies: the decodes of requests that hold their KV cost one token each and
    # nothing in memory, so a higher-priority prefill chunk is trimmed to leave them room (up to
    # the policy's decode_share of the budget) instead of taking the whole step. Without it a
    # top-queue prompt idles every demoted decode for a step per chunk (simulator, chat mix:
    # mean end-to-end latency 27% above FCFS's; with half the budget, 6% below; BENCHMARKS.md).
    decode_room = 0
    if preemptive:
        decode_room = _count_resident_decodes(sched, int(budget * sched.policy.decode_share))
    mark = int(sched.config.watermark * sched.kv.device.num_blocks)

    def headroom(req: Request) -> int:
        """Blocks a request without KV must leave free when others run: admitting requests until
        the pool is exactly full makes the next step's decodes preempt (and recompute) someone."""
        return mark if (scheduled or sched.running) and not sched.kv.num_device_blocks_of(req.request_id) else 0

    def allocate(req: Request, num_new: int, hits: list[KVBlock]) -> bool:
        # num_new excludes the cached hits, so this counts the fresh blocks only; without a
        # headroom, allocate_slots's own check is the whole test.
        room = headroom(req)
        if room and sched.kv.num_blocks_needed(req, num_new) + room > sched.kv.num_free_blocks:
            return False
        return sched.kv.allocate_slots(req, num_new, hits)

    def candidates() -> Iterator[Request]:
        """The waiting requests in the policy's order, read no further than admission goes."""
        seen = set()
        for req in sched.policy.order(sched.waiting, sched.now):
            if blocked is not None or (decode_room > 0 and budget <= decode_room):
                # Behind a blocked head, or once the budget left is the decodes' share, only
                # requests that already hold KV may run; under overload they are a few among
                # thousands, so they are looked up, not scanned for.
                rest = [r for r in sched.waiting_holders() if r.request_id not in seen]
                yield from sched.policy.order(rest, sched.now)
                return
            seen.add(req.request_id)
            yield req

    capacity = LatencyCapacity.of(sched)
    for req in candidates():
        if budget <= 0 or len(sched.running) >= sched.config.max_num_seqs:
            break
        if req.status == RequestStatus.SWAPPED:
            continue  # swapped out by make_room for the blocked head
        if blocked is not None and not sched.kv.num_device_blocks_of(req.request_id):
            continue
        if capacity is not None and not capacity.admits(req):
            if preemptive:
                continue
            break  # over the latency capacity, requests queue in order (Parrot's baseline: FIFO)
        decode = decode_room > 0 and _is_resident_decode(sched, req)
        if decode_room > 0 and not decode and budget <= decode_room:
            continue  # no room for another chunk in this step
        hits, num_hit = ([], 0)
        if req.num_computed_tokens == 0:
            hits, num_hit = sched.kv.get_computed_blocks(req)
            if blocked is None and _load_host_hits(sched, req, hits, out):
                continue
        num_new = min(req.num_tokens - req.num_computed_tokens - num_hit, budget)
        if decode_room > 0 and not decode:
            num_new = min(num_new, budget - decode_room)
        if not allocate(req, num_new, hits):
            if blocked is not None:
                # Behind the blocked head, a holder that cannot grow takes the blocks from holders
                # that rank below it: with every holder stuck, a full pool would run nothing.
                if not (preemptive and room_for_holder(sched, req, num_new, out) and allocate(req, num_new, hits)):
                    continue
            else:
                # What to free for it: its blocks less its cached hits. Not the watermark: discarding
                # paused contexts to keep headroom defeats the headroom (measured: more recompute).
                need = sched.kv.num_blocks_needed(req, num_new) - len(hits)
                freed = sched.paused.release_for_memory(need, sched.now)
                blocked = _Blocked(req, num_new, hits, need)
                if preemptive and sched.kv.num_free_blocks < need:
                    blocked.swapping = make_room(sched, req, need, out) is Room.IN_FLIGHT
                if blocked.swapping:
                    continue  # swap-outs free the memory by the next step
                if preemptive:
                    if not (freed and allocate(req, num_new, hits)):
                        continue
                elif not ((freed or release_waiting_kv(sched, req, need)) and allocate(req, num_new, hits)):
                    break
                blocked = None
        _admit(sched, req, num_new, num_hit, scheduled)
        if capacity is not None:
            capacity.add(req)
        budget -= num_new
        if decode:
            decode_room -= 1
    if preemptive and blocked is not None and not blocked.swapping and not scheduled:
        # Nothing ran: without a discard, nothing would ever free memory.
        b = blocked
        if release_waiting_kv(sched, b.request, b.need) and allocate(b.request, b.num_new, b.hits):
            _admit(sched, b.request, b.num_new, len(b.hits) * sched.kv.block_size, scheduled)
            budget -= b.num_new
    return budget


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


def room_for_holder(sched: SchedulerState, holder: Request, num_new: int, out: SchedulerOutput) -> bool:
    """Preemptive policies, behind a blocked head: free the blocks a request that holds KV needs for
    its next tokens. Preserved paused contexts go first (InferCept's rule), then waiting holders
    that rank below it: swapped out when the host has room (the memory comes next step), else
    discarded (they recompute later). Without this, once the host is full a pool of waiting
    holders that each need one more block runs nothing but the few with room in their last block
    (simulator, MLFQ at 5 req/s on the InferCept trace: 1-2 running requests, 20 tokens a step,
    0.3 requests finished per second). True when the blocks are free now."""
    need = sched.kv.num_blocks_needed(holder, num_new)
    sched.paused.release_for_memory(need, sched.now)
    if sched.kv.num_free_blocks >= need:
        return True
    if make_room(sched, holder, need, out) is Room.IN_FLIGHT:
        return False
    if sched.kv.host is not None and sched.kv.host.num_free_blocks >= need - sched.kv.num_free_blocks:
        return False  # the host can take them, within a later step's swap budget
    below = holders_below(sched, holder, partly_swapped_in=False)
    for victim in sched.policy.preemption_order(below, sched.now):
        if sched.kv.num_free_blocks >= need:
            break
        _discard(sched, victim)
    return sched.kv.num_free_blocks >= need


def _discard(sched: SchedulerState, req: Request) -> None:
    """Drop a waiting request's device KV; it recomputes when it runs again."""
    sched.kv.free(req)
    req.num_computed_tokens = 0
    req.num_preemptions += 1
    sched.num_preemptions_total += 1


def release_waiting_kv(sched: SchedulerState, head: Request, need_blocks: int) -> bool:
    """When nothing runs, nothing will ever free memory: requests that wait while holding KV
    (resumed preserved or swapped-in contexts) could block the head of the queue forever.
    Drop the KV of the lowest-priority holders (they recompute later). True if any freed."""
    if sched.running:
        return False
    freed = False
    # Partly swapped-in requests first (their host prefix is kept; the device part will be
    # recomputed after it), the policy's first victim first, then waiting holders from the back
    # of the queue.
    partly_in = [r for r in sched.paused.swapped if sched.kv.num_device_blocks_of(r.request_id)]
    holders = (sched.policy.preemption_order(partly_in, sched.now)
               + list(reversed(list(sched.policy.order(sched.waiting_holders(), sched.now)))))
    for req in holders:
        if req is head or not sched.kv.num_device_blocks_of(req.request_id):
            continue
        if req.status == RequestStatus.SWAPPED:
            # Its host part continues its device part, so both go (into the caches, where its
            # next admission finds what is still there) and it queues again from the start.
            sched.kv.release(req)
            sched.paused.swapped.remove(req)
            req.status = RequestStatus.WAITING
            sched.waiting.append(req)
            req.num_preemptions += 1
            sched.num_preemptions_total += 1
        else:
            _discard(sched, req)
        freed = True
        if sched.kv.num_free_blocks >= need_blocks:
            break
    return freed


def _load_host_hits(sched: SchedulerState, req: Request, device_hits: list[KVBlock], out: SchedulerOutput) -> bool:
    """A request whose prefix goes on past its device hits into the host tier takes those
    host blocks and swaps them in like a resumed swapped-out request (the first chunk now,
    the rest within later steps' swap limits, before it runs) instead of recomputing them.
    Only when this step can start the copy: a step that only queued it would look idle.
    True if it did."""
    host_hits = sched.kv.get_host_hits(req, len(device_hits))
    if not host_hits:
        return False
    budget = swap_budget_blocks(sched)
    free = sched.kv.num_free_blocks - sum(1 for b in device_hits if b.ref_cnt == 0)
    if budget <= 0 or free <= 0:
        return False
    sched.kv.attach_host_hits(req, device_hits, host_hits)
    if req.num_cached_tokens < 0:
        req.num_cached_tokens = req.num_computed_tokens
        sched.prefix_hit_tokens += req.num_computed_tokens
        sched.prefix_query_tokens += req.num_prompt_tokens
    sched.waiting.remove(req)
    out.blocks_to_swap_in += sched.paused.begin_swap_in(req, budget)
    return True


def _admit(sched: SchedulerState, req: Request, num_new: int, num_hit: int,
           scheduled: list[tuple[Request, int]]) -> None:
    if req.num_cached_tokens < 0:
        req.num_cached_tokens = num_hit
        sched.prefix_hit_tokens += num_hit
        sched.prefix_query_tokens += req.num_prompt_tokens
    req.num_computed_tokens += num_hit
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
            and req.num_tokens - req.num_computed_tokens == 1 and sched.kv.num_device_blocks_of(req.request_id) > 0)
