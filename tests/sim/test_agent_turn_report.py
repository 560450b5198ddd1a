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


def test_ttft_fields_summarize_first_and_later_turns():
    f = ttft_fields([1.0, 2.0, 3.0, 10.0], [0.5])
    assert set(f) == set(FIELDS)
    assert f["first_ttft_mean_s"] == 4.0 and f["first_ttft_p50_s"] == 2.5
    assert 3.0 < f["first_ttft_p90_s"] <= 10.0
    assert f["later_ttft_mean_s"] == f["later_ttft_p50_s"] == f["later_ttft_p90_s"] == 0.5
    assert all(v is None for v in ttft_fields([], []).values())


def test_the_client_tells_first_turns_from_later_ones():
    def t(start: float, first: float | None) -> TurnRecord:
        return TurnRecord(start, first, start + 5.0, 100, 0, 8)
    recs = [AgentRecord(0, 0.0, 9.0, 1.0, [t(0.0, 4.0), t(6.0, 6.5)]),
            AgentRecord(1, 1.0, 9.0, 0.0, [t(1.0, None), t(7.0, 8.0), t(9.0, 9.25)])]
    assert turn_ttfts(recs) == ([4.0], [0.5, 1.0, 0.25])


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
        assert all(isinstance(r[k], float) for k in FIELDS)
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
