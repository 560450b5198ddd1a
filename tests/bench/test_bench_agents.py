"""The agent workload (shared system prompt, multi-turn, tools between turns, history re-sent) on
the simulator, with KV invariants after every step, and Parrot's chain / map-reduce programs."""
from __future__ import annotations

import pytest

from segue.bench.agents import parse_agent_config
from segue.config import CacheConfig, EngineConfig, SchedulerConfig
from segue.sched.cost_model import PRESETS
from segue.sim.agent_replay import run_agents
from segue.sim.engine import make_sim_engine
from segue.sim.programs import ProgramSpec, run_program
from segue.sim.workloads.agents import AgentSpec, draw_agents, system_prompt_ids, task_ids

SMALL = AgentSpec(num_agents=6, arrival_window_s=2.0, turns_min=2, turns_max=4, output_tokens=8,
                  system_tokens=96, task_tokens=16, tool_result_tokens=24, tool_median_s=0.5, tool_cap_s=2.0)


def sim_engine(interception: str = "min-waste", kv_tokens: int = 1024, prefix_caching: bool = True,
               capacity: int | None = None):
    cost = PRESETS["gptj-6b-a100"]
    config = EngineConfig(cache=CacheConfig(block_size=16, kv_cache_tokens=kv_tokens, swap_space_tokens=kv_tokens,
                                            enable_prefix_caching=prefix_caching),
                          scheduler=SchedulerConfig(max_num_batched_tokens=256, interception_policy=interception,
                                                    latency_capacity_tokens=capacity))
    return make_sim_engine(cost, kv_tokens, config, max_model_len=2048)


def test_draw_is_deterministic_and_within_bounds() -> None:
    a, b = draw_agents(SMALL), draw_agents(SMALL)
    assert [(x.arrival_s, x.tool_s) for x in a] == [(x.arrival_s, x.tool_s) for x in b]
    assert all(SMALL.turns_min <= x.num_turns <= SMALL.turns_max for x in a)
    assert all(0 < t <= SMALL.tool_cap_s for x in a for t in x.tool_s)
    assert all(0 <= x.arrival_s <= SMALL.arrival_window_s for x in a)
    vocab = (1000, 40000)
    # Every agent's prompt starts with the same system prompt and differs after it.
    sys_ids = system_prompt_ids(SMALL, vocab)
    assert len(sys_ids) == SMALL.system_tokens
    assert task_ids(SMALL, a[0], vocab) != task_ids(SMALL, a[1], vocab)


@pytest.mark.parametrize("mode,policy", [("plain", "discard"), ("sessions", "discard"), ("sessions", "preserve"),
                                         ("sessions", "swap"), ("sessions", "min-waste"), ("sessions", "ttl"),
                                         ("auto", "min-waste"), ("auto", "discard"), ("auto", "preserve")])
def test_agents_finish_with_invariants(mode: str, policy: str) -> None:
    engine = sim_engine(policy)
    agents = draw_agents(SMALL)
    res = run_agents(engine, SMALL, agents, mode, engine.clock.advance_to, check_invariants=True)
    assert len(res.busy_s) == SMALL.num_agents and not res.stalled
    assert all(b > 0 for b in res.busy_s)
    # The shared system prompt is served from the prefix cache for all but the first agent(s).
    assert res.prefix_hit_tokens / res.prefix_query_tokens > 0.4


def test_plain_turns_hit_the_prefix_cache_beyond_the_system_prompt() -> None:
    """A plain client's later turn re-sends the held context: its prompt is served from the cache
    up to the last full block of the previous turn."""
    engine = sim_engine("discard", kv_tokens=4096)
    spec = AgentSpec(num_agents=1, turns_min=3, turns_max=3, output_tokens=8, system_tokens=96, task_tokens=16,
                     tool_result_tokens=24, tool_median_s=0.5, tool_cap_s=2.0)
    res = run_agents(engine, spec, draw_agents(spec), "plain", engine.clock.advance_to, check_invariants=True)
    prompts = [96 + 16, 96 + 16 + 8 + 24, 96 + 16 + 2 * (8 + 24)]
    # Turn k's cached part: the full blocks of turn k-1's prompt + output.
    cached = sum((p + 8) // 16 * 16 for p in prompts[:-1])
    assert res.prefix_query_tokens == sum(prompts)
    assert res.prefix_hit_tokens >= cached - 16 * 2


def test_agent_config_parsing() -> None:
    cfg = parse_agent_config("mw=mode:sessions,interception:min-waste,target:sim", "engine")
    assert (cfg.name, cfg.mode, cfg.interception, cfg.target) == ("mw", "sessions", "min-waste", "sim")
    url = parse_agent_config("v=url:http://h:1/v1,mode:plain,model:m", "engine")
    assert (url.target, url.url, url.model) == ("url", "http://h:1/v1", "m")
    with pytest.raises(SystemExit):
        parse_agent_config("x=mode:other", "engine")


@pytest.mark.parametrize("workload", ["chain", "map-reduce"])
def test_programs_beat_request_centric_in_the_simulator(workload: str) -> None:
    spec = ProgramSpec(workload, num_chunks=6, chunk_tokens=256, output_tokens=32, rtt_s=0.25)
    base_engine = sim_engine(kv_tokens=16384, prefix_caching=False, capacity=512)
    base = run_program(base_engine, spec, False, base_engine.clock.advance_to, check_invariants=True)
    prog_engine = sim_engine(kv_tokens=16384, capacity=512)
    prog = run_program(prog_engine, spec, True, prog_engine.clock.advance_to, check_invariants=True)
    assert base["calls"] == prog["calls"] == (6 if workload == "chain" else 7)
    assert prog["e2e_s"] < base["e2e_s"]
    if workload == "map-reduce":
        # The maps share their instruction through the prefix cache only on the program side.
        assert prog["prefix_hit_tokens"] > 0 and base["prefix_hit_tokens"] == 0
