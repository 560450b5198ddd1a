"""Agents as the scheduler sees them, for every client: identity, the tool gap, and the history
kept on the device across it (issue 25; Continuum's pinned KV, ThunderAgent's program view).

A turn belongs to an agent when its prompt extends the token chain of that agent's latest finished
turn into what the turn produced (a plain OpenAI client re-sends the whole history), found through
the prefix cache's block hashes, under the same program id. When a turn of a likely agent
finishes, its cached context is retained (held, not evictable) until the agent is expected back:
the learnt return gap. Retained contexts are what thrashing avoidance protects: admission lets a
newcomer use only the memory they leave (sched/admission.py), and under pressure the one expected
back last, per recompute second it would save, is released first. The tracker decides which
histories go and when (expiry, a turn that continues one, release_order); it detaches them and
sched/memory_kept.py releases them with the KV manager. Pure Python.
"""
from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass, field

from segue.kv.interface import KVCache, RetainedContext
from segue.request import Request, RequestStatus
from segue.sched.cost_model import CostModel
from segue.tools.stats import DurationWindow


@dataclass
class AgentState:
    agent_id: int
    # When its first turn arrived: every later turn queues by it (program-level FCFS).
    first_arrival: float
    turns: int = 1
    last_finish: float = -math.inf
    # Its history while it is in a tool call; None when nothing is retained.
    context: RetainedContext | None = None
    # When it is expected back and when its context stops being retained.
    expected_back: float = math.inf
    retain_until: float = -math.inf
    # A finished turn whose outcome (came back or not) is not known yet.
    awaiting_return: bool = False
    # The client's own name for it (Request.program_id: a session or a program); None: a plain client.
    program_id: str | None = None
    # Chain-end hashes of its latest finished turn, not yet continued: what its next turn extends.
    chain_ends: list[int] = field(default_factory=list)


class ReturnGaps:
    """The gaps after which agents came back (tool time plus client time), recent ones only.
    Before any agent came back, `prior_s` stands in (replaced by the first observations)."""

    def __init__(self, prior_s: float, window: int = 256) -> None:
        self.prior_s = prior_s
        # Kept sorted as it fills (the tools' duration window): admission asks for a quantile per
        # waiting request and step.
        self._gaps = DurationWindow(window)
        # Outcomes of retained contexts: came back in time, or let go unused.
        self.returned = 0
        self.missed = 0

    def observe(self, gap_s: float) -> None:
        self._gaps.add(max(0.0, gap_s))

    def mean(self) -> float:
        return self._gaps.mean() if self._gaps.order else self.prior_s

    def quantile(self, q: float) -> float:
        # The nearest rank at or above q (not interpolated): a gap some agent really took.
        ordered = self._gaps.sorted
        if not ordered:
            return self.prior_s
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]

    def p_return(self) -> float:
        # Laplace-smoothed: with no evidence a finished turn is as likely to return as not.
        return (self.returned + 1) / (self.returned + self.missed + 2)


class AgentTracker:
    """Per-agent state for the scheduler; owns the retained contexts (through the KV manager)."""

    def __init__(self, kv: KVCache, cost: CostModel, prior_gap_s: float = 10.0,
                 max_agents: int = 4096) -> None:
        self.kv = kv
        self.cost = cost
        self.gaps = ReturnGaps(prior_gap_s)
        self.max_agents = max_agents
        self._agents: OrderedDict[int, AgentState] = OrderedDict()
        self._next_id = 0
        # The last full block's hash of an agent's latest finished turn -> (the agent, the
        # turn's tokens after that block): where the next turn's prompt meets the history (at
        # the end of the context and of the computed context). Several agents may end a block
        # apart with different tails (a system prompt's end, each with its own short answer).
        self._chain_ends: dict[int, list[tuple[int, tuple[int, ...]]]] = {}
        self._of_request: dict[str, AgentState] = {}
        # Agents with a retained context or an open outcome: what expire() looks at each step.
        self._watched: set[int] = set()

    # ---- identity ------------------------------------------------------------------------
    def on_arrival(self, request: Request, now: float) -> list[RetainedContext]:
        """Find the agent a new request continues (its prompt extends a finished turn's chain),
        or start a new one. Call before the ordering policy sees the request. Returns the
        histories of the agents forgotten to stay within max_agents, for the caller to release."""
        agent = self._continued(request)
        if agent is None:
            agent = AgentState(self._next_id, request.sched_arrival_time, turns=0, program_id=request.program_id)
            self._next_id += 1
        else:
            # A later turn queues by its agent's arrival, as a session's resumed request keeps its
            # own: an agent under way goes before agents that started after it, so the pool serves
            # agents through instead of starting new ones whose histories push theirs out
            # (simulator, pressure preset, seeds 1-3: mean agent time 16.6/9.0/20.4 s with each
            # turn's own arrival, 15.9/8.9/17.8 s with the agent's; BENCHMARKS.md).
            request.sched_arrival_time = min(request.sched_arrival_time, agent.first_arrival)
        if agent.awaiting_return:
            self.gaps.observe(now - agent.last_finish)
            self.gaps.returned += 1
            agent.awaiting_return = False
        agent.turns += 1
        self._agents[agent.agent_id] = agent
        self._agents.move_to_end(agent.agent_id)
        self._of_request[request.request_id] = agent
        return self._forget_oldest()

    def _continued(self, request: Request) -> AgentState | None:
        """The agent whose latest finished turn this request's prompt extends, if any. Linking
        hands the request its agent's first arrival, a place in line ahead of everyone who came
        since, so it takes evidence that an unrelated request does not have: the prompt reaches
        past the earlier turn's own prompt into what that turn produced (a chain end's block and
        the turn's tokens after it; a prompt's last full block alone is often the end of a system
        prompt that every client of the tenant shares), that turn is its agent's latest, no other
        request continued it already (a chain end is used once: a copy of the history is a fork,
        not the same agent), and the client names the same program, if it names one."""
        hashes = self.kv.full_block_hashes(request)
        for end in range(len(hashes), 0, -1):
            start = end * self.kv.block_size
            for aid, tail in self._chain_ends.get(hashes[end - 1], ()):
                agent = self._agents.get(aid)
                if (agent is not None and agent.program_id == request.program_id
                        and tuple(request.tokens_slice(start, start + len(tail))) == tail):
                    self._drop_chain_ends(agent)
                    return agent
        return None

    def _drop_chain_ends(self, agent: AgentState) -> None:
        for h in agent.chain_ends:
            rest = [e for e in self._chain_ends.get(h, ()) if e[0] != agent.agent_id]
            if rest:
                self._chain_ends[h] = rest
            else:
                self._chain_ends.pop(h, None)
        agent.chain_ends = []

    def agent_of(self, request: Request) -> AgentState | None:
        return self._of_request.get(request.request_id)

    def is_resident(self, request: Request) -> bool:
        """Whether a request continues an agent whose history is still retained on the device."""
        agent = self._of_request.get(request.request_id)
        return agent is not None and agent.context is not None

    # ---- a turn starts and ends ----------------------------------------------------------
    def take_history(self, request: Request) -> RetainedContext | None:
        """Detach the history retained for this request's agent, if there is one, for the caller
        to release: when the turn is admitted (it holds what it hit of the history now, and the
        handle lets the rest go), and before on_finish (a turn that never ran, aborted while
        waiting or finished without being admitted, will not use it now, so holding it to
        retain_until would only keep its memory from everyone else)."""
        agent = self._of_request.get(request.request_id)
        if agent is not None and agent.context is not None:
            return self.detach(agent)
        return None

    def on_finish(self, request: Request, now: float) -> bool:
        """A request finished (its unused history already taken: take_history). True when its
        context was retained for its agent's next turn (the rest of its KV is freed); False: the
        caller frees its KV."""
        agent = self._of_request.pop(request.request_id, None)
        if agent is None:
            return False
        assert agent.context is None, "take_history() first: a finishing turn's history is released"
        if request.status is RequestStatus.FINISHED_ABORTED:
            return False
        self._drop_chain_ends(agent)
        hashes = self.kv.full_block_hashes(request)
        bs = self.kv.block_size
        for stop in {request.num_tokens, request.num_computed_tokens}:
            end = stop // bs
            # Only a context that reaches into the turn's output: see _continued.
            if stop > request.num_prompt_tokens and 0 < end <= len(hashes):
                tail = tuple(request.tokens_slice(end * bs, stop))
                self._chain_ends.setdefault(hashes[end - 1], []).append((agent.agent_id, tail))
                agent.chain_ends.append(hashes[end - 1])
        agent.last_finish = now
        agent.awaiting_return = True
        self._watched.add(agent.agent_id)
        if self.gaps.p_return() < 0.5 or not self.kv.held(request.request_id).device:
            return False
        agent.context = self.kv.retain(request)
        agent.expected_back = now + self.gaps.mean()
        agent.retain_until = now + self.gaps.quantile(0.9)
        return True

    # ---- releasing retained contexts -----------------------------------------------------
    def expire(self, now: float) -> list[RetainedContext]:
        """Let go of contexts whose agent did not come back within the usual gap (p90), and
        count a turn as not continued once twice that has passed: the evidence that decides
        whether finished turns are retained at all (a one-off chat request is not). Returns the
        contexts let go, in order, for the caller to release."""
        expired = []
        horizon = 2 * self.gaps.quantile(0.9)
        for aid in list(self._watched):
            agent = self._agents.get(aid)
            if agent is None:
                self._watched.discard(aid)
                continue
            if agent.context is not None and now >= agent.retain_until:
                expired.append(self.detach(agent))
            if agent.awaiting_return and now >= agent.last_finish + horizon:
                agent.awaiting_return = False
                self.gaps.missed += 1
            if agent.context is None and not agent.awaiting_return:
                self._watched.discard(aid)
        return expired

    def release_order(self, now: float, keep: AgentState | None = None) -> list[AgentState]:
        """The agents whose retained contexts go under memory pressure, the least valuable first:
        memory-time held (private blocks x time until expected back; an overdue agent is expected
        as late again as it is overdue) per second of recompute its loss costs. `keep`'s own
        context stays."""
        return sorted(self._holders(keep), key=lambda a: self._hold_cost(a, now), reverse=True)

    def releasable(self, keep: AgentState | None = None) -> list[RetainedContext]:
        """The contexts release_order offers (all but `keep`'s)."""
        return [_held(a) for a in self._holders(keep)]

    def _holders(self, keep: AgentState | None) -> list[AgentState]:
        return [a for a in self._agents.values() if a.context is not None and a is not keep]

    def _hold_cost(self, agent: AgentState, now: float) -> float:
        context = _held(agent)
        blocks = context.num_private_blocks()
        due = agent.expected_back
        wait = due - now if due >= now else now - due
        recompute_s = self.cost.t_prefill(context.num_blocks * self.kv.block_size)
        return blocks * max(wait, 1e-3) / max(recompute_s, 1e-9)

    def detach(self, agent: AgentState) -> RetainedContext:
        """Take an agent's retained context off it; the caller releases it (sched/memory_kept.py)."""
        context = _held(agent)
        agent.context = None
        return context

    def _forget_oldest(self) -> list[RetainedContext]:
        forgotten = []
        while len(self._agents) > self.max_agents:
            _, agent = self._agents.popitem(last=False)
            self._drop_chain_ends(agent)
            if agent.context is not None:
                forgotten.append(self.detach(agent))
        return forgotten


def _held(agent: AgentState) -> RetainedContext:
    """The context of an agent that holds one (the holders _holders() lists)."""
    assert agent.context is not None, "this agent retains no context"
    return agent.context
