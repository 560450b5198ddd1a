"""Releasing the memory kept for requests that do not run: paused contexts and agents' retained
histories. Their owners choose (sched/paused.py: the interception policy's decisions each step,
the order contexts go in under memory pressure, an abandoned request; sched/agents.py: expiry,
a history handed to the turn that continues it, a finished turn's unused history, forgotten
agents, the order histories go in); this module carries the choices out with the KV manager, in
the order given. With sched/memory.py, which takes these as two of its sources (the PAUSED and
HISTORIES rows of sched/memory_table.py), it is the memory owner: the only modules that call the
release verbs (tests/test_architecture.py). Pure Python.
"""
from __future__ import annotations

import math

from segue.kv.interface import RetainedContext
from segue.request import Disposition, Request
from segue.sched.agents import AgentState
from segue.sched.paused import SwapPlan
from segue.sched.state import SchedulerState


# ---- paused contexts ---------------------------------------------------------------------------
def release_paused(sched: SchedulerState, req: Request, reuse_at: float | None = None) -> None:
    """Discard as release: the blocks return to the prefix cache, kept in order of expected reuse,
    and a resume revives those still there (see KVCacheManager.release). `reuse_at` defaults to
    the known or predicted resume time (PausedRequests.known_resume_at says why)."""
    if reuse_at is None:
        reuse_at = sched.paused.known_resume_at(req)
    sched.kv.release(req, reuse_at, sched.cost.t_fwd_extra(sched.kv.block_size))
    sched.paused.set_disposition(req, Disposition.DISCARD)


def release_paused_blocks(sched: SchedulerState, blocks_needed: int) -> int:
    """Release paused contexts in PausedRequests.release_order until `blocks_needed` device
    blocks came free (the source Source.PAUSED). Returns blocks freed."""
    freed = 0
    for req in sched.paused.release_order(sched.now):
        if freed >= blocks_needed:
            break
        before = sched.kv.counters().num_free_blocks
        release_paused(sched, req)
        freed += sched.kv.counters().num_free_blocks - before
    return freed


def abandon(sched: SchedulerState, request_id: str) -> bool:
    """Nobody is expected to continue this paused request: its context goes now, first in line
    for eviction (PausedRequests.abandon). False if it is not paused."""
    req = sched.paused.abandon(request_id)
    if req is None:
        return False
    release_paused(sched, req, reuse_at=math.inf)
    return True


def carry_out(sched: SchedulerState, plan: SwapPlan) -> None:
    """Carry out the interception policy's decisions of this step's plan, in its order; their
    swap-out copies join the plan's. A policy that keeps within the budget in tokens does in
    blocks too (a partial block rounds up to a whole copy); one that asks for more on purpose
    (`swap`) gets it."""
    bs = sched.kv.block_size
    decisions = plan.decisions
    asked = sum(d.swap_out_tokens for d in decisions.values() if d.disposition is Disposition.SWAP)
    blocks_left = plan.swap_out_budget // bs if asked <= plan.swap_out_budget else math.inf
    for rid, decision in decisions.items():
        req = sched.paused.paused[rid]
        sched.paused.set_disposition(req, decision.disposition)
        if decision.disposition is Disposition.SWAP and decision.swap_out_tokens > 0:
            copies = sched.kv.swap_out(req, int(min(-(-decision.swap_out_tokens // bs), blocks_left))).copies
            plan.swap_out += copies
            blocks_left -= len(copies)
        elif decision.disposition is Disposition.DISCARD:
            release_paused(sched, req)


# ---- agents' retained histories ----------------------------------------------------------------
def release_histories(sched: SchedulerState, contexts: list[RetainedContext]) -> None:
    """Release the histories an AgentTracker let go (expired, forgotten), in its order."""
    for context in contexts:
        sched.kv.release_retained(context)


def release_history_blocks(sched: SchedulerState, blocks_needed: int, keep: AgentState | None) -> int:
    """Release retained histories in AgentTracker.release_order (all but `keep`'s) until
    `blocks_needed` device blocks came free (the source Source.HISTORIES). Returns blocks freed."""
    agents = sched.agents
    assert agents is not None
    freed = 0
    for agent in agents.release_order(sched.now, keep):
        if freed >= blocks_needed:
            break
        freed += sched.kv.release_retained(agents.detach(agent))
    return freed


def hand_over(sched: SchedulerState, req: Request) -> None:
    """An admitted turn holds what it hit of its agent's history: the retained handle goes."""
    context = sched.agents.take_history(req) if sched.agents is not None else None
    if context is not None:
        sched.kv.release_retained(context)


def free_finished(sched: SchedulerState, request: Request) -> None:
    """Free a finished request's KV, unless its agent's next turn keeps it (retained); under
    prefix_eviction="reuse" its cached blocks are keyed by their expected reuse (KVCache.finish).
    A history kept for a turn that never ran goes first."""
    agents = sched.agents
    if agents is not None:
        unused = agents.take_history(request)
        if unused is not None:
            sched.kv.release_retained(unused)
        if agents.on_finish(request, sched.now):
            return
    sched.kv.finish(request, sched.now, sched.cost.t_fwd_extra(sched.kv.block_size))
