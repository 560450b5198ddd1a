"""Freeing device memory for admission (sched/admission.py): a holder behind a blocked head takes
blocks from holders below it, a head that nothing else will ever make room for takes them from
waiting holders, and a request whose prefix continues in the host tier loads it instead of
recomputing it. Pure Python.

Who gives device memory to whom, everywhere in the scheduler (each site keeps its own order, and
the orders differ on purpose, so they are listed here rather than merged into one routine):

1. A running request that cannot grow (Scheduler._schedule_running): paused contexts
   (PausedRequests.release_for_memory: the latest expected back first, then the largest), then
   retained agent histories (AgentTracker.release_for_memory: the highest memory-time per
   recompute second first), then a running request not yet scheduled this step is preempted
   (the policy's preemption_order; it recomputes).
2. A waiting request at admission (Admission._make_room): paused contexts; retained histories
   only when nothing runs; then under a preemptive policy lower-ranked waiting holders are
   swapped out (preemption.make_room; never dropped), under a non-preemptive one waiting holders
   are discarded when nothing runs (release_waiting_kv, below).
3. Behind a blocked head, under a preemptive policy, a holder that cannot grow (room_for_holder):
   paused contexts, then holders ranked below it swapped out, then (host full) discarded.
4. A step in which nothing ran (Admission.finish, preemptive): the blocked head discards waiting
   holders (release_waiting_kv).
5. Thrashing avoidance, non-preemptive with agents (thrashing.fit_beside_agents): paused contexts,
   then other agents' retained histories, only when together they cover the whole shortfall.
6. A swap-in waiting while nothing runs (Scheduler._plan_swaps): retained histories.
7. The arrival reserve of a preemptive policy (preemption.keep_reserve): the longest-waiting
   holders are swapped out proactively, within the step's link budget.
8. Every step, the interception policy (PausedRequests.plan) preserves, swaps or discards each
   paused context; retained histories expire on their own (AgentTracker.expire).
The KV side of each of these is a KVCache verb (segue/kv/interface.py): release, release_retained,
free, swap_out.
"""
from __future__ import annotations

from segue.kv.interface import PrefixHit
from segue.request import Request, RequestStatus
from segue.sched.output import SchedulerOutput
from segue.sched.preemption import Room, holders_below, make_room, swap_budget_blocks
from segue.sched.state import SchedulerState


def room_for_holder(sched: SchedulerState, holder: Request, num_new: int, out: SchedulerOutput) -> bool:
    """Preemptive policies, behind a blocked head: free the blocks a request that holds KV needs for
    its next tokens. Preserved paused contexts go first (InferCept's rule), then waiting holders
    that rank below it: swapped out when the host has room (the memory comes next step), else
    discarded (they recompute later). Without this, once the host is full a pool of waiting
    holders that each need one more block runs nothing but the few with room in their last block
    (simulator, MLFQ at 5 req/s on the InferCept trace: 1-2 running requests, 20 tokens a step,
    0.3 requests finished per second). True when the blocks are free now."""
    kv = sched.kv
    need = kv.num_blocks_needed(holder, num_new)
    sched.paused.release_for_memory(need, sched.now)
    if kv.counters().num_free_blocks >= need:
        return True
    if make_room(sched, holder, need, out) is Room.IN_FLIGHT:
        return False
    pools = kv.counters()
    if pools.has_host_tier and pools.num_free_host_blocks >= need - pools.num_free_blocks:
        return False  # the host can take them, within a later step's swap budget
    below = holders_below(sched, holder, partly_swapped_in=False)
    for victim in sched.policy.preemption_order(below, sched.now):
        if kv.counters().num_free_blocks >= need:
            break
        discard(sched, victim)
    return kv.counters().num_free_blocks >= need


def discard(sched: SchedulerState, req: Request) -> None:
    """Drop a waiting request's device KV; it recomputes when it runs again."""
    sched.kv.free(req)
    req.num_computed_tokens = 0
    req.num_preemptions += 1
    sched.num_preemptions_total += 1


def release_waiting_kv(sched: SchedulerState, head: Request, need_blocks: int) -> bool:
    """When nothing runs, nothing will ever free memory: requests that wait while holding KV
    (resumed preserved or swapped-in contexts) could block the head of the queue forever.
    Drop the KV of the lowest-priority holders (they recompute later). True if any freed.
    Swap-outs in flight free their blocks by the next step: when they cover the need, the head
    waits one step instead (real engine, sessions under pressure: every turn of a batch paused
    at once, min-waste swapped their contexts out, and the head discarded a resumed turn's
    resident context in the same step, 3-11 recomputes a run)."""
    if sched.running:
        return False
    pools = sched.kv.counters()
    if pools.num_free_blocks + pools.num_swapping_out_blocks >= need_blocks:
        return False
    freed = False
    # Partly swapped-in requests first (their host prefix is kept; the device part will be
    # recomputed after it), the policy's first victim first, then waiting holders from the back
    # of the queue.
    partly_in = [r for r in sched.paused.swapped if sched.kv.held(r.request_id).device]
    holders = (sched.policy.preemption_order(partly_in, sched.now)
               + list(reversed(list(sched.policy.order(sched.waiting_holders(), sched.now)))))
    for req in holders:
        if req is head or not sched.kv.held(req.request_id).device:
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
            discard(sched, req)
        freed = True
        if sched.kv.counters().num_free_blocks >= need_blocks:
            break
    return freed


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
    if sched.agents is not None:
        sched.agents.on_admitted(req)
    if req.num_cached_tokens < 0:
        req.num_cached_tokens = req.num_computed_tokens
        sched.prefix_hit_tokens += req.num_computed_tokens
        sched.prefix_query_tokens += req.num_prompt_tokens
    sched.waiting.remove(req)
    out.blocks_to_swap_in += sched.paused.begin_swap_in(req, budget)
    return True
