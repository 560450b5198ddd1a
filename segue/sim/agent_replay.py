"""The agent workload on an engine object: the in-process engine (wall clock) or the simulator
(virtual clock), with token ids that really share the system prompt.

Modes, as the HTTP client's:

- `plain`: every turn is a new request whose prompt is the whole conversation so far (system
  prompt, task, and each earlier turn's generated tokens and tool result); only the prefix cache
  links the turns, as for an OpenAI client that re-sends its history.
- `sessions`: one request per agent that pauses after each turn for the tool's time and resumes
  with the tool result appended (a trace script), as a Segue session or an auto-continued plain
  client does; the interception policy decides what the pause costs. The session is closed with
  the last turn (the client says it is done).
- `auto`: `sessions` as a plain client with auto-continuation gets it: nobody says the last turn
  was the last, so it is held like the others; after `HeldTurnTimes.release_s` it is released to
  the prefix cache (Scheduler.abandon) and after `ttl_s` aborted, as the server's
  auto-continuation does.

Both modes feed the engine the same token sequences, so a turn's prompt in `plain` is exactly
what the paused request holds in `sessions`.
"""
from __future__ import annotations

import heapq
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from segue.engine.engine_request import EngineRequest
from segue.sampling_params import SamplingParams
from segue.sim.agent_report import ttft_fields
from segue.sim.replay import token_range
from segue.sim.script import scripted
from segue.sim.trace import TURN, TraceSegment
from segue.sim.workloads.agents import Agent, AgentSpec, system_prompt_ids, task_ids, tool_result_ids

MODES = ("plain", "sessions", "auto")


@dataclass(frozen=True)
class HeldTurnTimes:
    """How long `auto` holds an agent's finished turn: released to the prefix cache after
    `release_s`, aborted after `ttl_s` (the server's auto-continuation, server/auto_continue.py)."""
    release_s: float = 10.0
    ttl_s: float = 60.0


@dataclass
class _AgentState:
    agent: Agent
    arrival: float
    context: list[int]
    turn: int = 0
    end: float | None = None
    # Per turn: when it was sent (a session's next turn: when its tool ends) and its first token.
    turn_starts: dict[int, float] = field(default_factory=dict)
    first_tokens: dict[int, float] = field(default_factory=dict)

    def ttfts(self, end: float) -> dict[int, tuple[float, bool]]:
        """Each sent turn's time to first token, and whether it got one: a turn that never did
        counts its wait until `end` (the run's end), a lower bound, rather than dropping out."""
        return {t: (self.first_tokens.get(t, end) - s, t in self.first_tokens) for t, s in self.turn_starts.items()}


@dataclass
class EngineAgentResult:
    busy_s: list[float]          # per finished agent: agent time minus tool time
    num_agents: int
    duration_s: float
    wall_s: float
    preemptions: int
    prefix_hit_tokens: int
    prefix_query_tokens: int
    waste: dict[str, float]
    steps: int
    stalled: bool = False
    # Prompt-side tokens the engine computed: every batched token but the decode feeds (each
    # turn's generated tokens but its last, which the next turn's prompt or append carries).
    computed_prompt_tokens: int = 0
    # Time to first token of agents' first turns (a newcomer's wait) and of their later turns;
    # turns that never got one are in them at their wait until the run's end, and counted here.
    first_turn_ttft_s: list[float] = field(default_factory=list)
    later_turn_ttft_s: list[float] = field(default_factory=list)
    ttft_no_token: tuple[int, int] = (0, 0)

    def to_dict(self) -> dict[str, Any]:
        return {"busy_s": self.busy_s, "num_agents": self.num_agents, "num_finished": len(self.busy_s),
                "first_turn_ttft_s": self.first_turn_ttft_s, "later_turn_ttft_s": self.later_turn_ttft_s,
                **ttft_fields(self.first_turn_ttft_s, self.later_turn_ttft_s, self.ttft_no_token),
                "duration_s": self.duration_s, "wall_s": self.wall_s, "preemptions": self.preemptions,
                "prefix_hit_tokens": self.prefix_hit_tokens, "prefix_query_tokens": self.prefix_query_tokens,
                "waste_gbs": self.waste, "steps": self.steps, "stalled": self.stalled,
                "computed_prompt_tokens": self.computed_prompt_tokens}


def run_agents(engine: Any, spec: AgentSpec, agents: list[Agent], mode: str, clock_wait: Callable[[float], None],
               check_invariants: bool = False, deadline_s: float | None = None,
               held: HeldTurnTimes = HeldTurnTimes()) -> EngineAgentResult:
    """Drive `engine` (LLMEngine, real or simulated) through the agents; `clock_wait(t)` returns
    once engine.clock() >= t."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}")
    release_s, ttl_s = held.release_s, held.ttl_s
    vocab = token_range(engine.model_config.vocab_size)
    system = system_prompt_ids(spec, vocab)
    params = SamplingParams(temperature=0, max_tokens=spec.output_tokens, ignore_eos=True)
    start = engine.clock()
    sched = engine.scheduler.state  # its counters, read before and after the run
    hit0, query0 = sched.prefix_hit_tokens, sched.prefix_query_tokens
    pre0, steps0 = sched.num_preemptions_total, engine.num_steps
    batched0 = sched.num_batched_tokens_total
    waste0 = engine.waste.totals.as_dict()
    states = {a.index: _AgentState(a, start + a.arrival_s, system + task_ids(spec, a, vocab)) for a in agents}
    # (time, seq, agent index, action): an agent's next turn is due (its arrival, or its tool's
    # end), or (auto) its held last turn is released or dropped.
    due = [(s.arrival, a.index, a.index, "turn") for a, s in ((a, states[a.index]) for a in agents)]
    heapq.heapify(due)
    seq = len(due)
    wall0 = time.perf_counter()
    stalled = False
    gap = [release_s / 2]  # the server's initial guess (auto_continue.py)
    last = start

    def submit(st: _AgentState, at: float) -> None:
        a = st.agent
        if mode == "plain":
            st.turn_starts[st.turn] = at
            engine.add_request(EngineRequest(list(st.context), params, f"a{a.index}-t{st.turn}", arrival_time=at))
            return
        st.turn_starts[0] = at
        # Each pause ends a turn, as on the server: the client runs the tool and sends its result
        # as the next message.
        script = [TraceSegment(spec.output_tokens, a.tool_s[t], tool_result_ids(spec, a, t, vocab), kind=TURN)
                  for t in range(a.num_turns - 1)] + [TraceSegment(spec.output_tokens)]
        if mode == "auto":
            # Held after the last turn until dropped (the resume at 10 × TTL never comes).
            script[-1] = TraceSegment(spec.output_tokens, 10 * ttl_s, [vocab[0]], kind=TURN)
            script.append(TraceSegment(1))
        scripted(engine).add_request(EngineRequest(list(st.context), params, f"a{a.index}", arrival_time=at), script)

    def push(at: float, idx: int, action: str) -> None:
        nonlocal seq
        seq += 1
        heapq.heappush(due, (at, seq, idx, action))

    def finished(rid: str, token_ids: list[int], now: float) -> None:
        idx = int(rid[1:].split("-")[0])
        st = states[idx]
        if mode != "plain" or st.turn + 1 >= st.agent.num_turns:
            if st.end is None:
                st.end = now
            return
        st.context += list(token_ids) + tool_result_ids(spec, st.agent, st.turn, vocab)
        push(now + st.agent.tool_s[st.turn], idx, "turn")
        st.turn += 1

    def act(idx: int, action: str, at: float) -> None:
        rid = f"a{idx}"
        if action == "turn":
            submit(states[idx], at)
        elif action == "release":
            engine.scheduler.abandon(rid)
        elif action == "drop":
            engine.abort_request(rid)

    while due or engine.has_unfinished_requests():
        now = engine.clock()
        if deadline_s is not None and now - start > deadline_s:
            break
        while due and due[0][0] <= now:
            at, _, idx, action = heapq.heappop(due)
            act(idx, action, at)
        if engine.has_unfinished_requests():
            for out in engine.step():
                _time_turn(states, out, mode, spec.output_tokens, engine.clock())
                if out.finished:
                    last = max(last, engine.clock())
                    finished(out.request_id, out.outputs[0].token_ids, engine.clock())
                elif mode == "auto" and out.paused:
                    st = states[int(out.request_id[1:])]
                    turns_done = out.outputs[0].num_generated_tokens // spec.output_tokens
                    # As the server's sweep: every held turn is announced with the mean gap after
                    # which clients came back so far.
                    if turns_done >= 2:  # the tool before this turn has been seen through
                        gap[0] = 0.8 * gap[0] + 0.2 * st.agent.tool_s[turns_done - 2]
                    engine.scheduler.set_expected_resume(out.request_id, engine.clock() + gap[0])
                    if st.end is None and turns_done >= st.agent.num_turns:
                        st.end = last = max(last, engine.clock())
                        push(st.end + release_s, st.agent.index, "release")
                        push(st.end + ttl_s, st.agent.index, "drop")
            if check_invariants:
                engine.check_invariants()
            if not engine.last_step_idle:
                continue
        events = [t for t in (due[0][0] if due else None, engine.next_timer()) if t is not None]
        if not events:
            stalled = engine.has_unfinished_requests()
            break
        clock_wait(min(events))
    busy = [st.end - st.arrival - st.agent.total_tool_s for st in states.values() if st.end is not None]
    ttfts = [sorted(st.ttfts(engine.clock()).items()) for st in states.values()]
    first = [x for t in ttfts for turn, (x, _) in t if turn == 0]
    later = [x for t in ttfts for turn, (x, _) in t if turn > 0]
    no_token = (sum(not got for t in ttfts for turn, (_, got) in t if turn == 0),
                sum(not got for t in ttfts for turn, (_, got) in t if turn > 0))
    waste1 = engine.waste.totals.as_dict()
    turns_done = sum(st.agent.num_turns if st.end is not None else st.turn for st in states.values())
    return EngineAgentResult(
        busy, len(agents), last - start, time.perf_counter() - wall0,
        sched.num_preemptions_total - pre0, sched.prefix_hit_tokens - hit0,
        sched.prefix_query_tokens - query0, {k: waste1[k] - waste0.get(k, 0.0) for k in waste1},
        engine.num_steps - steps0, stalled,
        sched.num_batched_tokens_total - batched0 - turns_done * (spec.output_tokens - 1),
        first, later, no_token)


def _time_turn(states: dict[int, _AgentState], out: Any, mode: str, output_tokens: int, now: float) -> None:
    """Record a turn's first token, and (sessions) when the next turn is sent: its tool's end."""
    n = out.outputs[0].num_generated_tokens
    if n < 1:
        return
    head, _, tail = out.request_id[1:].partition("-t")
    st = states[int(head)]
    if mode == "plain":
        st.first_tokens.setdefault(int(tail), now)
        return
    turn = (n - 1) // output_tokens
    if turn < st.agent.num_turns:
        st.first_tokens.setdefault(turn, now)
    if n % output_tokens == 0 and turn + 1 < st.agent.num_turns:
        # The script pauses here and resumes after the tool (ScriptedRequests.after_token).
        st.turn_starts[turn + 1] = now + st.agent.tool_s[turn]
