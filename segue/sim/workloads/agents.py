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
from dataclasses import dataclass, field, replace

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
        """The --agent-preset's spec with every flag given on the command line over it."""
        base = AGENT_PRESETS[getattr(args, "agent_preset", None) or "light"]
        given = {field: getattr(args, flag) for field, flag in _FLAGS.items() if getattr(args, flag, None) is not None}
        return replace(base, **given)

    def min_prompt_tokens(self, agents: list["Agent"]) -> int:
        """The fewest prompt tokens any server must compute for these agents: every token that no
        earlier step computed, once — the shared system prompt, each task, each tool result, and
        each turn's last output token (sampled, never fed back); everything else of a history was
        computed before, as a prompt or as a decode, and could be served from cache."""
        per_turn = self.tool_result_tokens + 1
        return self.system_tokens + sum(self.task_tokens + (a.num_turns - 1) * per_turn for a in agents)

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


# Named workloads; flags given beside --agent-preset override its fields.
AGENT_PRESETS: dict[str, AgentSpec] = {
    # The light agent loop (the defaults): histories fit the pool, no pressure.
    "light": AgentSpec(),
    # Issue 25's pressure regime: 32 agents arriving about one a second, 3-6 turns, 300 tokens of
    # tool output appended a turn, tools of seconds. Final histories average ~2k tokens, so the
    # live histories of the agents in flight add up to several times an 8,192-token pool (run it
    # with --kv-cache-tokens 8192, or sweep the pool and --agents from no pressure to overload).
    "pressure": AgentSpec(num_agents=32, arrival_window_s=32.0, turns_min=3, turns_max=6,
                          tool_result_tokens=300),
}
# AgentSpec field -> argparse dest of its flag.
_FLAGS = {"num_agents": "agents", "arrival_window_s": "arrival_window_s", "turns_min": "turns_min",
          "turns_max": "turns_max", "output_tokens": "output_tokens", "tool_median_s": "tool_median_s",
          "tool_sigma": "tool_sigma", "tool_cap_s": "tool_cap_s", "system_tokens": "system_tokens",
          "task_tokens": "task_tokens", "tool_result_tokens": "tool_result_tokens", "seed": "seed"}


def add_agent_args(p: argparse.ArgumentParser, seed: bool = True) -> None:
    """Workload flags. Their defaults are None so that a flag given overrides --agent-preset and
    one not given takes the preset's value (the help shows the light preset's)."""
    d = AgentSpec()
    g = p.add_argument_group("agent workload")
    g.add_argument("--agent-preset", choices=sorted(AGENT_PRESETS), default="light",
                   help="light (default: histories fit the pool) or pressure (issue 25: 32 agents, 3-6 turns, "
                        "300-token tool results; run with --kv-cache-tokens 8192)")
    g.add_argument("--agents", type=int, default=None, help=f"number of agents (default: {d.num_agents})")
    g.add_argument("--arrival-window-s", type=float, default=None,
                   help=f"agents arrive uniformly over this window (default: {d.arrival_window_s:g})")
    g.add_argument("--turns-min", type=int, default=None, help=f"fewest turns per agent (default: {d.turns_min})")
    g.add_argument("--turns-max", type=int, default=None, help=f"most turns per agent (default: {d.turns_max})")
    g.add_argument("--output-tokens", type=int, default=None, help="tokens per turn (default: 32)")
    g.add_argument("--tool-median-s", type=float, default=None,
                   help=f"median tool time, log-normal (default: {d.tool_median_s:g})")
    g.add_argument("--tool-sigma", type=float, default=None, help="log-normal sigma of tool times")
    g.add_argument("--tool-cap-s", type=float, default=None, help=f"longest tool time (default: {d.tool_cap_s:g})")
    g.add_argument("--system-tokens", type=int, default=None, help="shared system prompt (tokens)")
    g.add_argument("--task-tokens", type=int, default=None, help="each agent's own task (tokens)")
    g.add_argument("--tool-result-tokens", type=int, default=None, help="each tool result (tokens)")
    if seed:
        g.add_argument("--seed", type=int, default=None, help="seeds the agents' turns and tool times")
