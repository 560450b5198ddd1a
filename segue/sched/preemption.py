"""Memory under a preemptive ordering policy (FastServe §4.2): how lower-priority requests give up
device KV when a higher-priority one needs it, and the proactive swap-out that keeps a reserve
free for arrivals. Used by the Scheduler; pure Python."""
from __future__ import annotations

import enum
from typing import TYPE_CHECKING

from segue.request import Request, RequestStatus
from segue.sched.output import SchedulerOutput

if TYPE_CHECKING:
    from segue.sched.scheduler import Scheduler


class Room(enum.Enum):
    FREED = "freed"          # device blocks are free now
    IN_FLIGHT = "in_flight"  # swap-outs free them when this step's copies are done
    NONE = "none"            # nothing of lower priority holds device memory


def make_room(sched: Scheduler, head: Request, need: int, out: SchedulerOutput) -> Room:
    """Preemptive policies: take device memory from lower-priority requests that are not running
    this step, in the policy's preemption order. Swap them out while the host has room (the
    head waits a step, nobody recomputes); otherwise drop their KV (they recompute later)."""
    head_key = sched.policy.key(head, sched.now)
    holders = [r for r in sched.waiting + sched.paused.swapped
               if r is not head and sched.kv.num_device_blocks_of(r.request_id)
               and sched.policy.key(r, sched.now) > head_key]
    if not holders:
        return Room.NONE
    victims = sched.policy.preemption_order(holders, sched.now)
    deficit = need - sched.kv.num_free_blocks
    host = sched.kv.host
    if host is not None and host.num_free_blocks >= deficit:
        for victim in victims:
            if deficit <= 0:
                break
            deficit -= swap_out(sched, victim, deficit, out)
        return Room.IN_FLIGHT
    for victim in victims:
        if sched.kv.num_free_blocks >= need:
            break
        if victim.status == RequestStatus.SWAPPED:
            sched.kv.discard_device_blocks(victim)
        else:
            sched.kv.free(victim)
            victim.num_computed_tokens = 0
            victim.status = RequestStatus.PREEMPTED
        victim.num_preemptions += 1
        sched.num_preemptions_total += 1
        out.preempted.append(victim)
    return Room.FREED


def swap_out(sched: Scheduler, req: Request, max_blocks: int, out: SchedulerOutput) -> int:
    """Move up to max_blocks of a waiting or swapped request's device KV to the host; a waiting
    one joins the swapped requests (swapped back in before it runs again). Blocks moved."""
    moved = sched.kv.swap_out_blocks(req, max_blocks)
    if moved and req.status != RequestStatus.SWAPPED:
        sched.waiting.remove(req)
        req.status = RequestStatus.SWAPPED
        sched.paused.swapped.append(req)
    out.blocks_to_swap_out += moved
    return len(moved)


def keep_reserve(sched: Scheduler, out: SchedulerOutput, reserve: int, now: float) -> None:
    """Proactive swapping (FastServe §4.2): keep `reserve` device blocks free for arrivals, and
    room for the swapped request expected to run soonest when it outranks a resident one, by
    swapping out the requests that wait the longest, within what the link moves during this
    step so the copies hide behind its compute."""
    bs = sched.kv.block_size
    budget = (sched.cost.swap_limit(sched.last_batch_tokens) // bs
              - len(out.blocks_to_swap_in) - len(out.blocks_to_swap_out))
    if budget <= 0 or sched.kv.host is None:
        return
    on_host = [r for r in sched.paused.swapped if sched.kv.num_host_blocks_of(r.request_id)]
    resident = [r for r in sched.waiting + sched.paused.swapped if sched.kv.num_device_blocks_of(r.request_id)]
    victims = sched.policy.preemption_order(list({id(r): r for r in resident + on_host}.values()), now)
    rank = {id(r): i for i, r in enumerate(victims)}
    waiting_resident = [r for r in resident if r.status != RequestStatus.SWAPPED]
    best_on_host, room_for_it = None, 0
    if on_host and waiting_resident:
        best_on_host = max(on_host, key=lambda r: rank[id(r)])
        if rank[id(best_on_host)] > min(rank[id(r)] for r in waiting_resident):
            room_for_it = sched.kv.num_host_blocks_of(best_on_host.request_id)
    deficit = reserve - sched.kv.num_free_blocks
    for req in victims:
        if req is best_on_host:
            room_for_it = 0  # the rest rank above it: they only give way to the reserve
        if deficit + room_for_it <= 0 or budget <= 0:
            break
        if not sched.kv.num_device_blocks_of(req.request_id):
            continue
        moved = swap_out(sched, req, budget, out)
        if not moved:
            break  # the host pool is full
        budget -= moved
        deficit -= moved
