"""The newcomer bound: how long a new agent's first turn may wait behind running agents, in seconds
of the scheduler's clock (`SchedulerConfig.max_newcomer_wait_s`). Pure Python.

Thrashing avoidance (sched/thrashing.py) protects running agents: their later turns queue by their
agent's first arrival (sched/agents.py) and their histories stay retained, so a new agent starts
only in the memory those leave. Under pressure that memory rarely comes: on an AMX Xeon (pressure
preset) a new agent's first token took 166 s at p90 against vLLM's 11 s, and the wait grows with
the machine's step time, not with anything the scheduler measures. Past the bound a newcomer goes
ahead: admission offers it before agents' later turns sent after it (`newcomers_first`; they
queue by their agent's first arrival, so without the bound they all go first), and it may release
idle agents' retained histories, as many as make it fit and no more (thrashing.py's all-or-nothing
release); short even then, it keeps the memory that frees up (head-of-line). It never releases a
paused context (a tool call's, a session's turn waiting on its client): whether that one is worth
keeping is the interception policy's cost to weigh, not a timer's.

A newcomer is a request of an agent's first turn (one no earlier turn links to) that has not
produced a token yet; a later turn is a request that continues an agent (a plain client's next
prompt) or a session resumed at a turn's end. A tool call's resume (the InferCept trace) is
neither: the bound never reorders it, and the context it is paused with is never released for a
newcomer (on the InferCept trace every plain request is a newcomer).
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator

from segue.request import Request
from segue.sched.state import SchedulerState


def is_newcomer(sched: SchedulerState, req: Request) -> bool:
    """A first turn that has not produced its first token (with agent tracking on)."""
    agents = sched.agents
    if agents is None or req.num_generated_tokens > 0:
        return False
    agent = agents.agent_of(req)
    return agent is not None and agent.turns == 1


def is_later_turn(sched: SchedulerState, req: Request) -> bool:
    """A turn after an agent's first: a plain client's next prompt, or a session resumed at a turn end."""
    if req.interceptions and req.interceptions[-1].turn_end:
        return True
    agents = sched.agents
    agent = agents.agent_of(req) if agents is not None else None
    return agent is not None and agent.turns > 1


def is_overdue(sched: SchedulerState, req: Request) -> bool:
    """A newcomer that has waited past the bound (measured from its arrival on the scheduler's clock)."""
    bound = sched.config.max_newcomer_wait_s
    # The cheap test first: admission asks for every waiting request it reaches.
    return bound is not None and sched.now - req.arrival_time >= bound and is_newcomer(sched, req)


def turn_arrival(req: Request) -> float:
    """When a turn was sent: a session's resumed turn when its resume came, others at arrival."""
    last = req.interceptions[-1] if req.interceptions else None
    return last.t_resume if last is not None and last.t_resume is not None else req.arrival_time


def _overdue(sched: SchedulerState, bound: float) -> Iterator[Request]:
    """The waiting newcomers past the bound, earliest arrival first, read from the index of first
    turns (sched/first_turns.py) rather than from the waiting queue; lazy."""
    for req in sched.first_turns.arrived_by(sched.now - bound):
        if req in sched.waiting and is_newcomer(sched, req):
            yield req


def newcomers_first(sched: SchedulerState, ordered: Iterable[Request]) -> Iterator[Request]:
    """`ordered` (the policy's order), with each overdue newcomer moved just ahead of the first
    later turn sent after it, as FCFS by each turn's own arrival would put it; the later turns
    ahead of that one, sent before it, keep their place. Lazy on both sides: `ordered` is read
    only as far as admission goes (under overload the queue holds thousands), and the overdue
    newcomers come from the index of first turns in arrival order, only as many as are moved."""
    bound = sched.config.max_newcomer_wait_s
    if bound is None:
        yield from ordered
        return
    overdue = _overdue(sched, bound)
    head = next(overdue, None)
    done: set[str] = set()
    for req in ordered:
        if is_later_turn(sched, req):
            sent = turn_arrival(req)
            while head is not None and head.arrival_time < sent:
                if head.request_id not in done:
                    done.add(head.request_id)
                    yield head
                head = next(overdue, None)
        if req.request_id not in done:
            done.add(req.request_id)
            yield req
