"""The agent workload against any OpenAI-compatible server (Segue, vLLM, ...), over HTTP.

Each agent is one conversation of streamed chat completions: system prompt + task, then after every
turn the model's answer and a tool result (sent as a user message: a tool message needs a real
tool call before it, which 32 forced tokens of a small model do not make), the whole history each
time. Between turns the client sleeps the tool's time. Modes:

- `plain`: standard OpenAI fields only (plus `ignore_eos` unless --no-ignore-eos), what any SDK sends.
- `sessions`: Segue's `open_session` on the first turn, then `session_id`; the session is closed
  (DELETE) after the last turn unless `keep_sessions` (an agent that just goes away).

The server's own counters (preemptions, KV waste, prefix-cache hits) are read from its Prometheus
`/metrics` before and after the run, for Segue's and vLLM's metric names.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
import numpy as np

from segue.bench.client import ClientConfig, OpenAIClient, ServerError
from segue.bench.filler import filler_text
from segue.sim.workloads.agents import Agent, AgentSpec

logger = logging.getLogger(__name__)
# One INFO line per HTTP request would drown the report.
logging.getLogger("httpx").setLevel(logging.WARNING)
MODES = ("plain", "sessions")


@dataclass
class TurnRecord:
    start: float
    first_token: float | None
    end: float
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int


@dataclass
class AgentRecord:
    index: int
    arrival: float
    end: float
    tool_s: float
    turns: list[TurnRecord] = field(default_factory=list)

    @property
    def busy_s(self) -> float:
        """Agent time minus tool time: what the server costs the agent."""
        return self.end - self.arrival - self.tool_s


def turn_ttfts(records: list[AgentRecord]) -> tuple[list[float], list[float], tuple[int, int]]:
    """Time to first token of the agents' first turns and of their later turns, and how many of
    each never got a token: those count with their wait until their stream ended (a lower bound),
    so a starved turn raises the percentiles instead of dropping out of them. The client knows
    which turn is an agent's first; the server may not."""
    first: list[float] = []
    later: list[float] = []
    no_token = [0, 0]
    for rec in records:
        for i, t in enumerate(rec.turns):
            (later if i else first).append((t.first_token if t.first_token is not None else t.end) - t.start)
            no_token[min(i, 1)] += t.first_token is None
    return first, later, (no_token[0], no_token[1])


@dataclass
class AgentTexts:
    """The workload's text, drawn once per run so every mode sends the same words."""
    system: str
    tasks: list[str]
    results: list[list[str]]

    @classmethod
    def draw(cls, spec: AgentSpec, agents: list[Agent], per_word: float) -> "AgentTexts":
        def words(tokens: int) -> int:
            return max(1, round(tokens / max(per_word, 1e-6)))
        system = filler_text(words(spec.system_tokens), np.random.default_rng([spec.seed, 800]))
        tasks = [filler_text(words(spec.task_tokens), np.random.default_rng([spec.seed, 80, a.content_seed]))
                 for a in agents]
        results = [[filler_text(words(spec.tool_result_tokens),
                                np.random.default_rng([spec.seed, 150, a.content_seed, t]))
                    for t in range(a.num_turns - 1)] for a in agents]
        return cls(system, tasks, results)


def _metrics_url(base_url: str) -> str:
    base = base_url.rstrip("/")
    return (base[:-3] if base.endswith("/v1") else base) + "/metrics"


# Counter names: Segue's, then vLLM's (v1 engine).
_COUNTERS = {
    "preemptions": ("segue_preemptions_total", "vllm:num_preemptions_total"),
    "prefix_hit_tokens": ("segue_prefix_cache_hit_tokens_total", "vllm:prefix_cache_hits_total"),
    "prefix_query_tokens": ("segue_prefix_cache_query_tokens_total", "vllm:prefix_cache_queries_total"),
    "step_seconds": ("segue_engine_step_seconds_total",),
    "modelled_step_seconds": ("segue_engine_modelled_step_seconds_total",),
}


async def scrape(http: httpx.AsyncClient, url: str) -> dict[str, float]:
    """The server's counters that this benchmark reports; {} if it has no /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        r = await http.get(url)
    except httpx.HTTPError:
        return {}
    if r.status_code != 200:
        return {}
    samples: dict[str, float] = {}
    waste: dict[str, float] = {}
    for fam in text_string_to_metric_families(r.text):
        for s in fam.samples:
            if s.name == "segue_kv_waste_gb_seconds_total":
                waste[s.labels.get("cause", "")] = s.value
            else:
                samples[s.name] = samples.get(s.name, 0.0) + s.value
    out: dict[str, float] = {}
    for key, names in _COUNTERS.items():
        for name in names:
            if name in samples:
                out[key] = samples[name]
                break
    for cause, v in waste.items():
        out[f"waste_{cause}_gbs"] = v
    return out


class AgentClient(OpenAIClient):
    def __init__(self, config: ClientConfig, spec: AgentSpec, mode: str, keep_sessions: bool = False) -> None:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}")
        super().__init__(config)
        self.spec, self.mode, self.keep_sessions = spec, mode, keep_sessions

    def _agent_body(self, messages: list[dict[str, str]], session_id: str | None, first: bool) -> dict[str, Any]:
        body: dict[str, Any] = {"model": self.model, "messages": messages, "max_tokens": self.spec.output_tokens,
                                "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
        if self.config.ignore_eos:
            body["ignore_eos"] = True
        if self.mode == "sessions":
            if session_id is not None:
                body["session_id"] = session_id
            elif first:
                body["open_session"] = True
        return body

    async def _turn(self, body: dict[str, Any]) -> tuple[TurnRecord, str, str | None]:
        start = time.monotonic()
        seg = await self._stream(body)
        rec = TurnRecord(start, seg.first_token_time, seg.end_time, seg.prompt_tokens, seg.cached_tokens,
                         seg.completion_tokens)
        return rec, seg.content, seg.session_id

    async def run_agent(self, agent: Agent, texts: AgentTexts, arrival: float) -> AgentRecord:
        messages = [{"role": "system", "content": texts.system}, {"role": "user", "content": texts.tasks[agent.index]}]
        rec = AgentRecord(agent.index, arrival, arrival, 0.0)
        session_id: str | None = None
        try:
            for t in range(agent.num_turns):
                turn, answer, sid = await self._turn(self._agent_body(messages, session_id, t == 0))
                session_id = sid or session_id
                rec.turns.append(turn)
                rec.end = turn.end
                if t + 1 == agent.num_turns:
                    break
                t0 = time.monotonic()
                await asyncio.sleep(agent.tool_s[t])
                rec.tool_s += time.monotonic() - t0
                messages += [{"role": "assistant", "content": answer},
                             {"role": "user", "content": texts.results[agent.index][t]}]
        finally:
            if session_id is not None and not self.keep_sessions:
                r = await self.http.delete(f"/sessions/{session_id}")
                if r.status_code not in (200, 404):
                    logger.warning("closing session %s: HTTP %d", session_id, r.status_code)
        return rec


async def drive_agents(config: ClientConfig, spec: AgentSpec, agents: list[Agent], mode: str,
                       keep_sessions: bool = False) -> dict[str, Any]:
    """Run every agent at its arrival time; returns the per-agent records and server counters."""
    client = AgentClient(config, spec, mode, keep_sessions)
    errors: list[str] = []
    records: list[AgentRecord] = []
    try:
        await client.setup()
        texts = AgentTexts.draw(spec, agents, client.calibration.per_word if config.calibrate else 1.0)
        metrics_url = _metrics_url(config.base_url)
        before = await scrape(client.http, metrics_url)
        start = time.monotonic() + 0.05

        async def one(agent: Agent) -> None:
            at = start + agent.arrival_s
            await asyncio.sleep(max(0.0, at - time.monotonic()))
            try:
                records.append(await client.run_agent(agent, texts, at))
            except (ServerError, httpx.HTTPError, json.JSONDecodeError, KeyError) as e:
                errors.append(f"agent {agent.index}: {type(e).__name__}: {e}")

        wall0 = time.monotonic()
        await asyncio.gather(*(one(a) for a in agents))
        wall = time.monotonic() - wall0
        after = await scrape(client.http, metrics_url)
    finally:
        await client.aclose()
    counters = {k: after[k] - before.get(k, 0.0) for k in after}
    return {"records": sorted(records, key=lambda r: r.index), "errors": errors, "wall_s": wall,
            "server": counters}
