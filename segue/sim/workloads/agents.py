"""The agent workload: many agents share one system prompt, each runs a few turns with a
client-side tool between them, and every turn re-sends the whole conversation.

This is what OpenAI-SDK agents and LangGraph loops send: turn k's prompt is the system prompt, the
agent's task, and for every earlier turn the model's answer and the tool's result. One draw fixes
every agent's arrival, turn count and tool durations, so every configuration (plain client,
sessions, auto-continuation, another server, the simulator) sees the same agents.

Content is given two ways from the same draw: token ids (the in-process engine and the
simulator, where the shared system prompt must really share token ids so the prefix cache sees it)
and text (HTTP servers; filler words of about one token each, see filler.py).
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True)
class AgentSpec:
    num_agents: int = 16
    arrival_window_s: float = 30.0
    turns_min: int = 2
    turns_max: int = 5
    output_tokens: int = 32
    tool_median_s: float = 3.0
    # sigma of the log-normal tool time (log space); median 3 s with sigma 0.8 puts p90 near 8 s.
    tool_sigma: float = 0.8
    tool_cap_s: float = 15.0
    system_tokens: int = 800
    task_tokens: int = 80
    tool_result_tokens: int = 150
    seed: int = 0

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "AgentSpec":
        return cls(num_agents=args.agents, arrival_window_s=args.arrival_window_s, turns_min=args.turns_min,
                   turns_max=args.turns_max, output_tokens=args.output_tokens, tool_median_s=args.tool_median_s,
                   tool_sigma=args.tool_sigma, tool_cap_s=args.tool_cap_s, system_tokens=args.system_tokens,
                   task_tokens=args.task_tokens, tool_result_tokens=args.tool_result_tokens, seed=args.seed)

    def describe(self) -> str:
        return (f"{self.num_agents} agents over {self.arrival_window_s:g} s, {self.turns_min}-{self.turns_max} turns "
                f"of {self.output_tokens} tokens, tools log-normal median {self.tool_median_s:g} s "
                f"(sigma {self.tool_sigma:g}, cap {self.tool_cap_s:g} s), system {self.system_tokens} + task "
                f"{self.task_tokens} tokens, tool results {self.tool_result_tokens} tokens, seed {self.seed}")


@dataclass
class Agent:
    index: int
    arrival_s: float
    # Tool time after each turn but the last (len = turns - 1).
    tool_s: list[float]
    # Seeds of the agent's own content (task, tool results), independent of the timing draw.
    content_seed: int = 0
    key: str = field(default="")

    @property
    def num_turns(self) -> int:
        return len(self.tool_s) + 1

    @property
    def total_tool_s(self) -> float:
        return float(sum(self.tool_s))


def draw_agents(spec: AgentSpec) -> list[Agent]:
    """Arrivals uniform over the window (sorted), turns uniform in [min, max], tool times log-normal
    around the median, capped."""
    if spec.turns_min < 1 or spec.turns_max < spec.turns_min:
        raise ValueError("turns must satisfy 1 <= min <= max")
    rng = np.random.default_rng([spec.seed, 19])
    arrivals = np.sort(rng.uniform(0.0, spec.arrival_window_s, size=spec.num_agents))
    agents = []
    for i, at in enumerate(arrivals):
        turns = int(rng.integers(spec.turns_min, spec.turns_max + 1))
        tools = np.minimum(spec.tool_cap_s, spec.tool_median_s * np.exp(rng.normal(0.0, spec.tool_sigma, turns - 1)))
        agents.append(Agent(i, float(at), [float(t) for t in tools], content_seed=i, key=f"agent{i}"))
    return agents


# ---- token-id content (engine, simulator) ----------------------------------------------------
def _ids(rng: np.random.Generator, n: int, vocab: tuple[int, int]) -> list[int]:
    lo, hi = vocab
    return [int(t) for t in rng.integers(lo, hi, size=n)]


def system_prompt_ids(spec: AgentSpec, vocab: tuple[int, int]) -> list[int]:
    return _ids(np.random.default_rng([spec.seed, 800]), spec.system_tokens, vocab)


def task_ids(spec: AgentSpec, agent: Agent, vocab: tuple[int, int]) -> list[int]:
    return _ids(np.random.default_rng([spec.seed, 80, agent.content_seed]), spec.task_tokens, vocab)


def tool_result_ids(spec: AgentSpec, agent: Agent, turn: int, vocab: tuple[int, int]) -> list[int]:
    return _ids(np.random.default_rng([spec.seed, 150, agent.content_seed, turn]), spec.tool_result_tokens, vocab)


def add_agent_args(p: argparse.ArgumentParser, seed: bool = True) -> None:
    d = AgentSpec()
    g = p.add_argument_group("agent workload")
    g.add_argument("--agents", type=int, default=d.num_agents, help=f"number of agents (default: {d.num_agents})")
    g.add_argument("--arrival-window-s", type=float, default=d.arrival_window_s,
                   help=f"agents arrive uniformly over this window (default: {d.arrival_window_s:g})")
    g.add_argument("--turns-min", type=int, default=d.turns_min)
    g.add_argument("--turns-max", type=int, default=d.turns_max)
    g.add_argument("--output-tokens", type=int, default=d.output_tokens, help="tokens per turn (default: 32)")
    g.add_argument("--tool-median-s", type=float, default=d.tool_median_s)
    g.add_argument("--tool-sigma", type=float, default=d.tool_sigma, help="log-normal sigma of tool times")
    g.add_argument("--tool-cap-s", type=float, default=d.tool_cap_s)
    g.add_argument("--system-tokens", type=int, default=d.system_tokens, help="shared system prompt (tokens)")
    g.add_argument("--task-tokens", type=int, default=d.task_tokens, help="each agent's own task (tokens)")
    g.add_argument("--tool-result-tokens", type=int, default=d.tool_result_tokens, help="each tool result (tokens)")
    if seed:
        g.add_argument("--seed", type=int, default=d.seed)
