"""Who gives up device KV under a preemptive ordering policy (FastServe §4.2), and in what order:
the lower-ranked holders a higher-ranked request swaps out, the holders a head discards when
nothing runs, and the longest-waiting holders swapped out to keep a reserve for arrivals. Only
choices: the memory they give is taken by sched/memory.py, at the site that asks. Pure Python."""
from __future__ import annotations

from collections.abc import Iterator

from segue.request import Request
from segue.sched.output import SchedulerOutput
from segue.sched.state import SchedulerState


def swap_victims(sched: SchedulerState, head: Request, need: int) -> list[Request]:
    """Lower-priority requests not running this step to swap out, in the policy's preemption
    order, so that `need` device blocks come free for `head`; empty when the head must wait.

    They are never dropped to recompute: under overload, killing pending requests to admit new
    ones restarts them over and over (FastServe's second strawman); when the host pool is full
    the head waits for memory instead. Only victims whose copy hides behind this step's compute
    are taken, so a large deficit is paid over several steps while the head waits, instead of
    stalling the whole batch for one request (4-5x less swap stall in the simulator's chat mix,
    BENCHMARKS.md)."""
    pools = sched.kv.counters()
    deficit = need - pools.num_free_blocks
    if not pools.has_host_tier or pools.num_free_host_blocks < deficit:
        return []
    holders = holders_below(sched, head, partly_swapped_in=True)
    # Whole victims: a request left half on the device could not run and would hold memory.
    budget = swap_budget_blocks(sched)
    chosen, room = [], 0
    for victim in sched.policy.preemption_order(holders, sched.now):
        # Only blocks it holds alone: a shared prefix stays for the requests that share it.
        blocks = sched.kv.num_private_blocks_of(victim.request_id)
        if room >= deficit:
            break
        if blocks and room + blocks <= min(pools.num_free_host_blocks, budget):
            chosen.append(victim)
            room += blocks
    return chosen


def holders_below(sched: SchedulerState, req: Request, partly_swapped_in: bool) -> list[Request]:
    """The waiting requests that hold device KV and rank below `req` in the policy's order (with
    `partly_swapped_in`, also swapped requests with part of their context back on the device)."""
    key = sched.policy.key(req, sched.now)
    candidates = sched.waiting_holders()
    if partly_swapped_in:
        candidates += [r for r in sched.paused.swapped if sched.kv.held(r.request_id).device]
    return [r for r in candidates if r is not req and sched.policy.key(r, sched.now) > key]


def discard_order(sched: SchedulerState) -> list[Request]:
    """The holders a head that nothing else will make room for discards, first to last:
    partly swapped-in requests first (their host prefix is kept; the device part will be
    recomputed after it), the policy's first victim first, then waiting holders from the back
    of the queue."""
    partly_in = [r for r in sched.paused.swapped if sched.kv.held(r.request_id).device]
    return (sched.policy.preemption_order(partly_in, sched.now)
            + list(reversed(list(sched.policy.order(sched.waiting_holders(), sched.now)))))


def swap_budget_blocks(sched: SchedulerState) -> int:
    """Blocks the link can still copy behind this step's compute: what this step's swap-ins,
    swap-outs and write-backs so far have left of its budget (KVCounters.link_budget)."""
    return sched.kv.counters().link_budget


def reserve_victims(sched: SchedulerState, out: SchedulerOutput, reserve: int,
                    now: float) -> Iterator[tuple[Request, int]]:
    """Proactive swapping (FastServe §4.2): the requests to swap out, with their blocks, to keep
    `reserve` device blocks free for arrivals, and room for the swapped request expected to run
    soonest when it outranks a resident one: those that wait the longest, within what the link
    moves during this step so the copies hide behind its compute. Requests go out whole or not at
    all. Lazy: each is chosen after the one before it was swapped out."""
    budget = swap_budget_blocks(sched)
    if budget <= 0 or sched.kv.counters().num_free_host_blocks == 0:
        return  # nothing can move this step; ranking an overloaded queue would be wasted work
    on_host = [r for r in sched.paused.swapped if sched.kv.held(r.request_id).host]
    waiting_resident = sched.waiting_holders()
    resident = waiting_resident + [r for r in sched.paused.swapped if sched.kv.held(r.request_id).device]
    # Blocks swapped out this step are free by the next one, except those earmarked for a head.
    deficit = reserve - (sched.kv.counters().num_free_blocks + len(out.blocks_to_swap_out) - sched.earmarked_blocks)
    if deficit <= 0 and not (on_host and waiting_resident):
        return
    victims = sched.policy.preemption_order(list({id(r): r for r in resident + on_host}.values()), now)
    rank = {id(r): i for i, r in enumerate(victims)}
    best_on_host, room_for_it = None, 0
    if on_host and waiting_resident:
        best_on_host = max(on_host, key=lambda r: rank[id(r)])
        if rank[id(best_on_host)] > min(rank[id(r)] for r in waiting_resident):
            room_for_it = sched.kv.held(best_on_host.request_id).host
    for req in victims:
        if req is best_on_host:
            room_for_it = 0  # the rest rank above it: they only give way to the reserve
        if deficit + room_for_it <= 0 or budget <= 0:
            break
        blocks = sched.kv.num_private_blocks_of(req.request_id)
        host_free = sched.kv.counters().num_free_host_blocks
        if not blocks or blocks > budget or blocks > host_free:
            continue  # whole requests only, and only what hides behind this step's compute
        yield req, blocks
        budget -= blocks
        deficit -= blocks
