"""Agent workload presets (light, pressure) and the computed-prompt-token accounting against the
minimum any server must compute."""
from __future__ import annotations

import argparse

import pytest

from segue.config import CacheConfig, EngineConfig, SchedulerConfig
from segue.sched.cost_model import PRESETS
from segue.sim.agent_replay import run_agents
from segue.sim.engine import make_sim_engine
from segue.sim.workloads.agents import AGENT_PRESETS, AgentSpec, add_agent_args, draw_agents


def _spec(*argv: str) -> AgentSpec:
    p = argparse.ArgumentParser()
    add_agent_args(p)
    return AgentSpec.from_args(p.parse_args(list(argv)))


def test_light_preset_is_todays_default_and_flags_override_a_preset():
    assert _spec() == AgentSpec() == AGENT_PRESETS["light"]
    assert _spec("--agents", "4") == AgentSpec(num_agents=4)
    pressure = _spec("--agent-preset", "pressure", "--agents", "8", "--seed", "3")
    assert (pressure.num_agents, pressure.seed, pressure.tool_result_tokens, pressure.turns_max) == (8, 3, 300, 6)


def test_pressure_histories_outgrow_an_8k_pool():
    spec = AGENT_PRESETS["pressure"]
    agents = draw_agents(spec)
    final = [spec.system_tokens + spec.task_tokens + (a.num_turns - 1) * (spec.output_tokens + spec.tool_result_tokens)
             for a in agents]
    assert sum(final) >= 3 * 8192 * 2  # all final histories together: several pools over


@pytest.mark.parametrize("mode", ["plain", "sessions"])
def test_computed_prompt_tokens_meet_the_minimum_with_room(mode):
    spec = AgentSpec(num_agents=3, arrival_window_s=1.0, turns_min=3, turns_max=3, output_tokens=8,
                     system_tokens=64, task_tokens=16, tool_result_tokens=40, tool_median_s=0.2, tool_cap_s=1.0)
    agents = draw_agents(spec)
    cost = PRESETS["gptj-6b-a100"]
    config = EngineConfig(cache=CacheConfig(block_size=16, kv_cache_tokens=8192, swap_space_tokens=0),
                          scheduler=SchedulerConfig(max_num_batched_tokens=256, interception_policy="preserve"))
    engine = make_sim_engine(cost, 8192, config, max_model_len=2048)
    res = run_agents(engine, spec, agents, mode, engine.clock.advance_to, check_invariants=True)
    least = spec.min_prompt_tokens(agents)
    assert least == 64 + 3 * (16 + 2 * 41)
    if mode == "sessions":
        # Preserved between turns: each appended token is computed exactly once (the shared system
        # prompt too, but for the first full-block hits the agents arriving together may miss).
        assert least <= res.computed_prompt_tokens <= least + 2 * 64
    else:
        # Plain clients re-send the history; the cache serves it but for each turn's partial block.
        assert least <= res.computed_prompt_tokens <= least + 2 * 64 + 3 * 3 * 16


def test_sim_agents_take_the_pressure_preset_and_an_eviction_order(capsys):
    from segue.sim.run import main

    assert main(["--workload", "agents", "--agent-preset", "pressure", "--agents", "6", "--kv-cache-tokens", "4096",
                 "--max-model-len", "4096", "--interception-policies", "min-waste", "--agent-modes", "plain",
                 "--prefix-eviction", "reuse", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "6 agents over 32 s, 3-6 turns" in out and "tool results 300 tokens" in out
    assert "| plain | sim | plain | server default | 6/6 |" in out and "×) |" in out


def test_sim_replays_a_slower_machine_with_the_step_time_scale(tmp_path):
    # `--step-time-scale` runs the preset's forward passes slower, as a served engine reports its
    # steps ran (segue_engine_step_seconds over segue_engine_modelled_step_seconds): agents wait longer.
    import json

    from segue.sim.run import main

    times = []
    for scale in ("1", "3"):
        path = tmp_path / f"agents-{scale}.json"
        assert main(["--workload", "agents", "--agent-preset", "pressure", "--agents", "6", "--kv-cache-tokens",
                     "4096", "--max-model-len", "4096", "--interception-policies", "min-waste", "--agent-modes",
                     "plain", "--no-progress", "--step-time-scale", scale, "--output-json", str(path)]) == 0
        rows = json.loads(path.read_text())["rows"]
        times.append(rows[0]["mean_busy_s"])
    assert times[1] > 1.5 * times[0]


def test_sim_agents_schedule_as_the_server_they_replay_and_traces_as_the_preset():
    # `segue sim --workload agents` stands for `segue serve` with the same flags: the step budget,
    # sequence limit and host tier it leaves unsaid are the server's; a program workload keeps
    # the preset's saturation point and vLLM's 256 sequences.
    from segue.sim.run import add_sim_args
    from segue.sim.workload_runs import _engine

    def config(*argv: str) -> tuple[SchedulerConfig, CacheConfig]:
        p = argparse.ArgumentParser()
        add_sim_args(p)
        engine = _engine(p.parse_args(["--kv-cache-tokens", "8192", *argv]))
        return engine.scheduler.state.config, engine.config.cache

    sched, cache = config("--workload", "agents")
    assert (sched.max_num_batched_tokens, sched.max_num_seqs) == (SchedulerConfig.max_num_batched_tokens,
                                                                  SchedulerConfig.max_num_seqs)
    assert cache.swap_space_tokens == CacheConfig.swap_space_tokens
    sched, _ = config("--workload", "agents", "--max-num-batched-tokens", "512", "--max-num-seqs", "8")
    assert (sched.max_num_batched_tokens, sched.max_num_seqs) == (512, 8)
    sched, cache = config("--workload", "chain")
    assert (sched.max_num_batched_tokens, sched.max_num_seqs) == (PRESETS["gptj-6b-a100"].saturation_tokens, 256)
    assert cache.swap_space_tokens == 8192
