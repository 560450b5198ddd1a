"""The agent report shows the trade that protecting running agents makes: first-turn and
later-turn TTFT (mean, p50, p90) beside agent time, on the simulator (`segue sim --workload
agents`), the in-process targets and a URL (`segue bench agents`, where the client knows which
turn is an agent's first)."""
from __future__ import annotations

import argparse
import json

import pytest

from segue.bench import agent_client
from segue.bench.agent_client import AgentRecord, TurnRecord, turn_ttfts
from segue.sim.agent_report import TTFT_KINDS, TTFT_STATS, render, ttft_fields

FIELDS = [f"{k}_ttft_{s}_s" for k in TTFT_KINDS for s in TTFT_STATS]
COUNTS = [f"{k}_ttft_no_token" for k in TTFT_KINDS]


def test_ttft_fields_summarize_first_and_later_turns():
    f = ttft_fields([1.0, 2.0, 3.0, 10.0], [0.5])
    assert set(f) == set(FIELDS) | set(COUNTS) and f["first_ttft_no_token"] == f["later_ttft_no_token"] == 0
    assert f["first_ttft_mean_s"] == 4.0 and f["first_ttft_p50_s"] == 2.5
    assert 3.0 < f["first_ttft_p90_s"] <= 10.0
    assert f["later_ttft_mean_s"] == f["later_ttft_p50_s"] == f["later_ttft_p90_s"] == 0.5
    assert all(ttft_fields([], [])[k] is None for k in FIELDS)


def test_the_client_tells_first_turns_from_later_ones():
    def t(start: float, first: float | None) -> TurnRecord:
        return TurnRecord(start, first, start + 5.0, 100, 0, 8)
    recs = [AgentRecord(0, 0.0, 9.0, 1.0, [t(0.0, 4.0), t(6.0, 6.5)]),
            AgentRecord(1, 1.0, 9.0, 0.0, [t(1.0, None), t(7.0, 8.0), t(9.0, 9.25)])]
    # The first turn of agent 1 never got a token: it counts with its wait until its stream ended
    # (5 s, a lower bound), not left out of the first-turn percentiles.
    assert turn_ttfts(recs) == ([4.0, 5.0], [0.5, 1.0, 0.25], (1, 0))


def test_a_turn_that_never_got_a_token_counts_at_the_runs_end():
    from segue.sim.agent_replay import _AgentState
    from segue.sim.workloads.agents import AGENT_PRESETS, draw_agents

    agent = draw_agents(AGENT_PRESETS["pressure"])[0]
    st = _AgentState(agent, arrival=0.0, context=[], turn_starts={0: 1.0, 1: 20.0}, first_tokens={0: 3.0})
    assert st.ttfts(end=50.0) == {0: (2.0, True), 1: (30.0, False)}
    # A starved newcomer raises the first-turn p90 instead of vanishing from it, and the table says so.
    served = [1.0] * 9
    row = {"config": "c", "target": "sim", "mode": "plain", "interception": None, "num_finished": 9,
           "num_agents": 10, "mean_busy_s": 1.0, "preemptions": 0, "recompute_gbs": 0.0, "waste_total_gbs": 0.0,
           "prefix_hit": 0.5, **ttft_fields(served + [300.0], [], (1, 0))}
    assert row["first_ttft_p90_s"] > 10 * ttft_fields(served, [])["first_ttft_p90_s"]
    table = render([row], "t")
    assert "(≥; 1 without a token)" in table and "never got a token" in table


def test_the_simulator_counts_newcomers_starved_until_the_deadline():
    from dataclasses import replace

    from segue.config import CacheConfig, EngineConfig, SchedulerConfig
    from segue.sched.cost_model import CostModel
    from segue.sim.agent_replay import run_agents
    from segue.sim.engine import make_sim_engine
    from segue.sim.workloads.agents import AGENT_PRESETS, draw_agents

    spec = replace(AGENT_PRESETS["pressure"], num_agents=32, arrival_window_s=2.0, seed=1)
    config = EngineConfig(cache=CacheConfig(block_size=16, kv_cache_tokens=3072, swap_space_tokens=0),
                          scheduler=SchedulerConfig(max_num_batched_tokens=2048, max_newcomer_wait_s=None))
    engine = make_sim_engine(CostModel().scaled(4.0), 3072, config, max_model_len=4096)
    deadline = 6.0
    res = run_agents(engine, spec, draw_agents(spec), "plain", engine.clock.advance_to, deadline_s=deadline)
    first_starved, _ = res.ttft_no_token
    # The run ended with first turns still waiting for memory: they are in the first-turn TTFTs
    # (at their wait until the deadline), beside those that got a token.
    assert 0 < first_starved < len(res.first_turn_ttft_s)
    assert max(res.first_turn_ttft_s) <= deadline + 2.0
    assert res.to_dict()["first_ttft_no_token"] == first_starved


def test_sim_table_and_json_carry_both_ttfts(tmp_path, capsys):
    from segue.sim.run import main

    path = tmp_path / "agents.json"
    assert main(["--workload", "agents", "--agent-preset", "pressure", "--agents", "6", "--kv-cache-tokens", "4096",
                 "--max-model-len", "4096", "--interception-policies", "min-waste", "--agent-modes", "plain,sessions",
                 "--no-progress", "--max-newcomer-wait-s", "2", "--output-json", str(path)]) == 0
    out = capsys.readouterr().out
    assert "first-turn TTFT mean / p50 / p90 (s) | later-turn TTFT mean / p50 / p90 (s)" in out
    rows = json.loads(path.read_text())["rows"]
    assert [r["config"] for r in rows] == ["plain", "sessions-min-waste"]
    for r in rows:
        assert all(isinstance(r[k], float) for k in FIELDS) and all(isinstance(r[k], int) for k in COUNTS)
        assert len(r["first_turn_ttft_s"]) == 6 and r["first_ttft_p90_s"] <= max(r["first_turn_ttft_s"])
        assert f"| {r['config']} | sim |" in out


def _bench_args(*argv: str) -> argparse.Namespace:
    from segue.bench.agents import add_arguments
    from segue.engine.args import add_engine_args

    p = argparse.ArgumentParser()
    add_arguments(p)
    add_engine_args(p)
    return p.parse_args(list(argv))


def test_bench_agents_on_the_simulator_reports_both_ttfts():
    from segue.bench.agents import parse_agent_config, run_config

    args = _bench_args("--target", "sim", "--preset", "gptj-6b-a100", "--agents", "4", "--turns-max", "3",
                       "--sim-kv-cache-tokens", "8192", "--max-model-len", "2048")
    row = run_config(args, parse_agent_config("plain=mode:plain", "sim"), None)
    assert row["num_finished"] == 4 and all(row[k] is not None for k in FIELDS)
    assert "| plain | sim | plain |" in render([row], "t")


def test_bench_agents_on_a_url_reports_both_ttfts(monkeypatch: pytest.MonkeyPatch):
    from segue.bench.agents import parse_agent_config, run_config

    async def fake_drive(config, spec, agents, mode, keep_sessions):
        recs = [AgentRecord(a.index, 0.0, 10.0, 0.0, [TurnRecord(0.0, 3.0 + a.index, 4.0, 900, 0, 32),
                                                       TurnRecord(5.0, 5.5, 6.0, 1200, 900, 32)]) for a in agents]
        return {"records": recs, "errors": [], "wall_s": 10.0, "server": {}}

    monkeypatch.setattr(agent_client, "drive_agents", fake_drive)
    args = _bench_args("--agents", "2")
    row = run_config(args, parse_agent_config("v=url:http://h:1/v1,mode:plain", "engine"), None)
    assert row["first_turn_ttft_s"] == [3.0, 4.0] and row["later_turn_ttft_s"] == [0.5, 0.5]
    assert row["first_ttft_mean_s"] == 3.5 and row["later_ttft_p90_s"] == 0.5
    assert "3.50 / 3.50 / 3.90 | 0.50 / 0.50 / 0.50" in render([row], "t")
