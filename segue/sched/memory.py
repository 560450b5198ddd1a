"""Freeing device memory for a request: one call per site (free_for_running, free_for_admission,
free_for_holder, free_for_idle_step, free_for_thrashing, free_for_swap_in, keep_reserve), each a
walk down its row of the table in sched/memory_table.py (the map of who gives memory to whom).
Who gives way within a source is its owner's choice (sched/preemption.py, the policy's order,
PausedRequests.release_order, AgentTracker.release_order); this module takes it, calling
KVCache's free, release and swap_out on the running and waiting requests, and
sched/memory_kept.py's releases for paused contexts and retained histories. The two modules are
the memory owner, the only ones that call the release verbs: tests/test_architecture.py checks
that. Pure Python.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from segue.kv.interface import PrefixHit
from segue.request import Request, RequestStatus
from segue.sched.agents import AgentState
from segue.sched.memory_kept import release_history_blocks, release_paused_blocks
from segue.sched.memory_table import FIRST_GIVER_ENDS, SOURCES, Ask, Site, Source, Step, When
from segue.sched.output import SchedulerOutput
from segue.sched.preemption import discard_order, holders_below, reserve_victims, swap_victims
from segue.sched.state import SchedulerState


@dataclass
class Claim:
    """One request's claim on device memory at one site, and what the sources gave it."""
    sched: SchedulerState
    site: Site
    request: Request | None
    need: int
    out: SchedulerOutput | None = None
    victims: list[Request] = field(default_factory=list)  # RUNNING: who may be preempted
    idle: bool = False  # ADMISSION: nothing runs and nothing was admitted this step
    allowed: frozenset[Source] = frozenset()  # THRASHING: the sources the fit test allows
    keep: AgentState | None = None  # THRASHING: the request's own history stays
    shortfall: Callable[[], int] | None = None  # THRASHING: its count of what is missing
    gave: bool = field(init=False, default=False)  # freed blocks, or took some request's KV
    in_flight: bool = field(init=False, default=False)  # swap-outs started: free next step
    preempted: Request | None = field(init=False, default=None)

    @property
    def short(self) -> int:
        if self.shortfall is not None:
            return self.shortfall()
        return self.need - self.sched.kv.counters().num_free_blocks

    def amount(self, ask: Ask) -> int:
        return self.need if ask is Ask.NEED else self.short


def _walk(claim: Claim) -> Claim:
    """Down the site's row: each source whose condition holds, in order, until swap-outs are on
    the way (the memory comes with the copies, so taking more now would take too much), or at
    a site that takes one source at a time, until one gave."""
    for step in SOURCES[claim.site]:
        if not _tries(claim, step):
            continue
        gave = _TAKE[step.source](claim, step.ask)
        claim.gave = claim.gave or gave
        if claim.in_flight or (gave and claim.site in FIRST_GIVER_ENDS):
            break
    return claim


def _tries(claim: Claim, step: Step) -> bool:
    when = step.when
    if when is When.ALWAYS:
        return True
    if when is When.SHORT:
        return claim.short > 0
    if when is When.IDLE_AND_SHORT:
        return claim.idle and claim.short > 0
    if when is When.NOTHING_GIVEN:
        return not claim.gave
    if when is When.ALLOWED:
        return step.source in claim.allowed
    assert when is When.HOST_FULL_AND_SHORT
    pools = claim.sched.kv.counters()
    host_takes_rest = pools.has_host_tier and pools.num_free_host_blocks >= claim.need - pools.num_free_blocks
    return claim.short > 0 and not host_takes_rest


# ---- one call per site -----------------------------------------------------------------------
def free_for_running(sched: SchedulerState, req: Request, num_new: int, victims: list[Request],
                     out: SchedulerOutput) -> Request | None:
    """One source's worth for a running request whose next `num_new` tokens do not fit; `victims`
    may be preempted. Returns the request preempted, if one was (it may be `req`)."""
    need = sched.kv.num_blocks_needed(req, num_new)
    return _walk(Claim(sched, Site.RUNNING, req, need, out, victims=victims)).preempted


def free_for_admission(sched: SchedulerState, req: Request, need: int, idle: bool,
                       out: SchedulerOutput) -> Claim:
    """Free `need` blocks for a waiting request that does not fit (`idle`: nothing runs and
    nothing was admitted this step). The claim says whether anything came free and whether
    swap-outs are on the way."""
    site = Site.ADMISSION_PREEMPTIVE if sched.policy.preemptive else Site.ADMISSION
    return _walk(Claim(sched, site, req, need, out, idle=idle))


def free_for_holder(sched: SchedulerState, holder: Request, num_new: int, out: SchedulerOutput) -> bool:
    """Preemptive policies, behind a blocked head: free the blocks a request that holds KV needs
    for its next tokens (with every holder stuck, a full pool would run nothing). Swapped-out
    victims free theirs next step, discarded ones now. True when the blocks are free now."""
    need = sched.kv.num_blocks_needed(holder, num_new)
    claim = _walk(Claim(sched, Site.HOLDER, holder, need, out))
    return not claim.in_flight and claim.short <= 0


def free_for_idle_step(sched: SchedulerState, head: Request, need: int) -> bool:
    """Nothing ran this step: without a discard, nothing would ever free memory for the blocked
    head. True if any holder gave way."""
    return _walk(Claim(sched, Site.IDLE_STEP, head, need)).gave


def free_for_thrashing(sched: SchedulerState, hit: PrefixHit, shortfall: Callable[[], int],
                       allowed: frozenset[Source], keep: AgentState | None) -> int:
    """Thrashing avoidance: release what `allowed` names for a request `shortfall()` blocks short,
    all or nothing: a release that leaves it waiting destroys others' KV for no admission, and
    the same candidate asks again next step, so it would cascade through every history and
    paused context. Returns the blocks still missing."""
    claim = Claim(sched, Site.THRASHING, None, 0, allowed=allowed, keep=keep, shortfall=shortfall)
    short = claim.short
    paused = sched.paused.releasable() if Source.PAUSED in allowed else []
    histories = sched.agents.releasable(keep) if Source.HISTORIES in allowed and sched.agents else []
    if not (paused or histories) or sched.kv.num_freed_by_release(paused, histories, hit) < short:
        return short
    return _walk(claim).short


def free_for_swap_in(sched: SchedulerState, keep_free: int) -> None:
    """Nothing runs, so nothing else will free memory for the swap-in that waits: a retained
    history gives it room (its host part, beside `keep_free` blocks) rather than the pool idling
    until the history expires. With requests running, swap-ins wait for memory as other requests
    do: taking it from retained histories there cascaded, each history loaded back from the host
    taking the next one's room (pressure preset, real engine)."""
    if sched.agents is None or not sched.paused.swapped or sched.running:
        return
    head = sched.paused.swapped[0]
    _walk(Claim(sched, Site.SWAP_IN, head, sched.kv.held(head.request_id).host + keep_free))


def keep_reserve(sched: SchedulerState, out: SchedulerOutput, reserve: int) -> None:
    """Proactive swapping (FastServe §4.2): keep `reserve` device blocks free for arrivals
    (preemption.reserve_victims says who goes)."""
    _walk(Claim(sched, Site.RESERVE, None, reserve, out))


# ---- the sources ------------------------------------------------------------------------------
def _release_paused(claim: Claim, ask: Ask) -> bool:
    sched = claim.sched
    return _release(claim, ask, lambda n: release_paused_blocks(sched, n))


def _release_histories(claim: Claim, ask: Ask) -> bool:
    sched = claim.sched
    if sched.agents is None:
        return False
    return _release(claim, ask, lambda n: release_history_blocks(sched, n, claim.keep))


def _release(claim: Claim, ask: Ask, release: Callable[[int], int]) -> bool:
    if ask is not Ask.UNTIL_COVERED:
        return release(claim.amount(ask)) > 0
    gave, short = False, claim.short
    while short > 0 and release(short):
        gave, short = True, claim.short
    return gave


def _preempt_running(claim: Claim, ask: Ask) -> bool:
    """Recompute-style preemption: drop the KV, keep the tokens, wait again."""
    sched = claim.sched
    victim = sched.policy.preemption_order(claim.victims, sched.now)[0]
    sched.running.remove(victim)
    sched.kv.free(victim)
    victim.num_computed_tokens = 0
    victim.status = RequestStatus.PREEMPTED
    _count_preemption(sched, victim)
    sched.waiting.append(victim)
    assert claim.out is not None
    claim.out.preempted.append(victim)
    claim.preempted = victim
    return True


def _swap_below(claim: Claim, ask: Ask) -> bool:
    sched, out = claim.sched, claim.out
    assert claim.request is not None and out is not None
    chosen = swap_victims(sched, claim.request, claim.amount(ask))
    for victim in chosen:
        swap_out(sched, victim, sched.kv.num_private_blocks_of(victim.request_id), out)
    if chosen:
        sched.earmarked_blocks += claim.need
        claim.in_flight = True
    return False  # nothing is free before the copies are done


def _discard_below(claim: Claim, ask: Ask) -> bool:
    sched, gave = claim.sched, False
    assert claim.request is not None
    below = holders_below(sched, claim.request, partly_swapped_in=False)
    for victim in sched.policy.preemption_order(below, sched.now):
        if claim.short <= 0:
            break
        discard(sched, victim)
        gave = True
    return gave


def _discard_waiting(claim: Claim, ask: Ask) -> bool:
    """Requests that wait while holding KV (resumed preserved or swapped-in contexts) could block
    the head forever when nothing runs: the lowest-priority ones give theirs up. Swap-outs in
    flight free their blocks by the next step: when they cover the need, the head waits one step
    instead (real engine, sessions under pressure: every turn of a batch paused at once,
    min-waste swapped their contexts out, and the head discarded a resumed turn's resident
    context in the same step, 3-11 recomputes a run)."""
    sched = claim.sched
    if sched.running:
        return False
    pools = sched.kv.counters()
    if pools.num_free_blocks + pools.num_swapping_out_blocks >= claim.need:
        return False
    gave = False
    for req in discard_order(sched):
        if req is claim.request or not sched.kv.held(req.request_id).device:
            continue
        if req.status == RequestStatus.SWAPPED:
            # Its host part continues its device part, so both go (into the caches, where its
            # next admission finds what is still there) and it queues again from the start.
            sched.kv.release(req)
            sched.paused.swapped.remove(req)
            req.status = RequestStatus.WAITING
            sched.waiting.append(req)
            _count_preemption(sched, req)
        else:
            discard(sched, req)
        gave = True
        if claim.short <= 0:
            break
    return gave


def _swap_longest_waiting(claim: Claim, ask: Ask) -> bool:
    sched, out = claim.sched, claim.out
    assert out is not None
    for req, blocks in reserve_victims(sched, out, claim.amount(ask), sched.now):
        swap_out(sched, req, blocks, out)
    return False  # the swap-outs free their blocks next step; nothing waits on this claim


_TAKE: dict[Source, Callable[[Claim, Ask], bool]] = {
    Source.PAUSED: _release_paused,
    Source.HISTORIES: _release_histories,
    Source.PREEMPT_RUNNING: _preempt_running,
    Source.SWAP_BELOW: _swap_below,
    Source.DISCARD_BELOW: _discard_below,
    Source.DISCARD_WAITING: _discard_waiting,
    Source.SWAP_LONGEST_WAITING: _swap_longest_waiting,
}


def discard(sched: SchedulerState, req: Request) -> None:
    """Drop a waiting request's device KV; it recomputes when it runs again."""
    sched.kv.free(req)
    req.num_computed_tokens = 0
    _count_preemption(sched, req)


def _count_preemption(sched: SchedulerState, req: Request) -> None:
    req.num_preemptions += 1
    sched.num_preemptions_total += 1


def swap_out(sched: SchedulerState, req: Request, max_blocks: int, out: SchedulerOutput) -> int:
    """Move up to max_blocks of a waiting or swapped request's device KV to the host; a waiting
    one joins the swapped requests (swapped back in before it runs again). Blocks moved."""
    moved = sched.kv.swap_out(req, max_blocks)
    # Counted in blocks moved, not copies: a block the host tier still holds moves without a
    # copy, and the request must leave the waiting queue all the same.
    if moved.blocks and req.status != RequestStatus.SWAPPED:
        sched.waiting.remove(req)
        req.status = RequestStatus.SWAPPED
        sched.paused.swapped.append(req)
    out.blocks_to_swap_out += moved.copies
    return moved.blocks
