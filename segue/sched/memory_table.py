"""The map of who gives device memory to whom: every place where the scheduler frees blocks for a
request (a Site) and the sources it takes them from, in order, with how much it asks of each and
when it tries each. sched/memory.py walks this table, so it is both the documentation and the
behaviour; tests/sched/test_memory.py checks each site's order.

The orders differ on purpose (the comments say why), so they are not merged into one. Which paused
context or history goes first within a source is its owner's order (sched/paused.py: the latest
expected back, then the largest; sched/agents.py: the most memory-time per recompute second);
which holders give way is the policy's (sched/preemption.py); the PAUSED and HISTORIES sources are
released by sched/memory_kept.py. Not a site: each step the interception policy preserves, swaps or
discards every paused context (PausedRequests.plan), and retained histories expire
(AgentTracker.expire); neither frees memory for a request, and sched/memory_kept.py carries both
out, as it does abandon(), a history handed to its next turn and a finished turn's. Pure Python.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass


class Site(enum.Enum):
    """Where a request needs device blocks that are not free (and who asks); sched/memory.py has
    one call per site."""
    RUNNING = "a running request that cannot grow (Scheduler._schedule_running)"
    ADMISSION = "a waiting request at admission, non-preemptive order (Admission._make_room)"
    ADMISSION_PREEMPTIVE = "a waiting request at admission, preemptive order (Admission._make_room)"
    HOLDER = "a holder behind a blocked head, preemptive order (Admission._make_room)"
    IDLE_STEP = "the blocked head of a step in which nothing ran, preemptive order (Admission.finish)"
    THRASHING = "a request admitted beside agents' histories, non-preemptive order (fit_beside_agents)"
    SWAP_IN = "a swap-in waiting while nothing runs (Scheduler._plan_swaps)"
    RESERVE = "the arrival reserve of a preemptive order (Scheduler.schedule)"


class Source(enum.Enum):
    """Whose memory a site takes."""
    PAUSED = "paused contexts, released (the latest expected back first, then the largest)"
    HISTORIES = "retained agent histories, released (the most memory-time per recompute second first)"
    PREEMPT_RUNNING = "a running request not yet scheduled this step, preempted (it recomputes)"
    SWAP_BELOW = "waiting holders ranked below, swapped out (within this step's link budget)"
    DISCARD_BELOW = "waiting holders ranked below, discarded (they recompute)"
    DISCARD_WAITING = "waiting holders, discarded when nothing runs (they recompute)"
    SWAP_LONGEST_WAITING = "the longest-waiting holders, swapped out (within this step's link budget)"


class Ask(enum.Enum):
    """How many blocks a site asks of a source."""
    NEED = "the whole need"
    SHORTFALL = "what is still missing"
    # A freed block that is one of the request's own cached hits frees no room for it.
    UNTIL_COVERED = "what is still missing, asked again while it gives and something is missing"


class When(enum.Enum):
    """When a site tries a source (else it goes on to the next)."""
    ALWAYS = "always"
    SHORT = "still short"
    IDLE_AND_SHORT = "nothing runs or was admitted this step, and still short"
    NOTHING_GIVEN = "the sources before gave nothing"
    HOST_FULL_AND_SHORT = "still short, and the host cannot take the rest (else a later swap-out frees it)"
    ALLOWED = "the caller allows this source for this request"


@dataclass(frozen=True)
class Step:
    """One source in a site's row: whose memory, how much is asked, and when it is tried."""
    source: Source
    ask: Ask = Ask.NEED
    when: When = When.ALWAYS


SOURCES: dict[Site, tuple[Step, ...]] = {
    # A retained history goes before a running request's context; the request preempted may be
    # the one that grows.
    Site.RUNNING: (Step(Source.PAUSED), Step(Source.HISTORIES), Step(Source.PREEMPT_RUNNING)),
    # Histories only when nothing runs: then they are the only memory that could ever come free.
    Site.ADMISSION: (Step(Source.PAUSED), Step(Source.HISTORIES, Ask.SHORTFALL, When.IDLE_AND_SHORT),
                     Step(Source.DISCARD_WAITING, when=When.NOTHING_GIVEN)),
    # Lower-ranked holders are swapped out, never dropped (preemption.swap_victims).
    Site.ADMISSION_PREEMPTIVE: (Step(Source.PAUSED), Step(Source.HISTORIES, Ask.SHORTFALL, When.IDLE_AND_SHORT),
                                Step(Source.SWAP_BELOW, when=When.SHORT)),
    # Without the discard, once the host is full a pool of waiting holders that each need one
    # more block runs nothing but the few with room in their last block (simulator, MLFQ at
    # 5 req/s on the InferCept trace: 1-2 running requests, 0.3 requests finished per second).
    Site.HOLDER: (Step(Source.PAUSED), Step(Source.SWAP_BELOW, when=When.SHORT),
                  Step(Source.DISCARD_BELOW, when=When.HOST_FULL_AND_SHORT)),
    # Nothing ran: without a discard nothing would ever free memory for the blocked head.
    Site.IDLE_STEP: (Step(Source.DISCARD_WAITING),),
    # Paused contexts first: they make no progress with their memory (sched/thrashing.py).
    Site.THRASHING: (Step(Source.PAUSED, Ask.UNTIL_COVERED, When.ALLOWED),
                     Step(Source.HISTORIES, Ask.UNTIL_COVERED, When.ALLOWED)),
    # Only while nothing runs (memory.free_for_swap_in): with requests running, taking histories
    # for swap-ins cascaded, each history loaded back taking the next one's room.
    Site.SWAP_IN: (Step(Source.HISTORIES, Ask.SHORTFALL, When.SHORT),),
    # FastServe's proactive swapping, within what the link moves behind this step's compute.
    Site.RESERVE: (Step(Source.SWAP_LONGEST_WAITING),),
}
# Sites whose call ends at the first source that gives anything (its caller tries again).
FIRST_GIVER_ENDS = frozenset({Site.RUNNING})
