"""`segue bench agents`: agents sharing a system prompt, multi-turn, client-side tools, the whole
history re-sent every turn (workloads/agents.py), on configurations side by side.

A configuration is `NAME=KEY:VALUE,...` with keys `target` (engine | sim | url), `url`, `model`,
`mode` (plain | sessions | auto: engine and simulator, a plain client's turns continued by the
server, the last one held until released, see agent_replay.py), `interception`, `policy`,
`keep_sessions` (url, sessions mode: never close a session, as an agent that just goes away). For
example:

  segue bench agents --url http://127.0.0.1:8000/v1 --modes plain,sessions       # Segue
  segue bench agents --url http://127.0.0.1:8765/v1 --modes plain --model NAME   # any OpenAI server
  segue bench agents --target engine --kv-cache-tokens 8192 --max-model-len 4096 \\
      --config plain=mode:plain --config mw=mode:sessions,interception:min-waste
  segue bench agents --target sim --preset prof.json --kv-cache-tokens 8192 --max-model-len 4096

Reported per configuration: mean agent time minus tool time (what the server costs an agent),
time to first token of agents' first turns and of their later turns (mean / p50 / p90: what holding
newcomers back for running agents trades), preemptions, recompute waste, and the prefix-cache hit
rate (the server's counters over the run).
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from dataclasses import dataclass
from typing import Any

from segue.bench import Benchmark
from segue.sim.agent_report import _f, _mean, render, ttft_fields

DEFAULT_CONFIGS = ("plain=mode:plain", "sessions-min-waste=mode:sessions,interception:min-waste",
                   "sessions-discard=mode:sessions,interception:discard",
                   "auto-min-waste=mode:auto,interception:min-waste")


@dataclass
class AgentRunConfig:
    name: str
    target: str = "engine"
    url: str | None = None
    model: str | None = None
    mode: str = "plain"
    interception: str | None = None
    policy: str | None = None
    keep_sessions: bool = False


def parse_agent_config(text: str, default_target: str) -> AgentRunConfig:
    name, sep, rest = text.partition("=")
    if not sep or not name.strip():
        raise SystemExit(f"--config wants NAME=KEY:VALUE,... (got {text!r})")
    cfg = AgentRunConfig(name.strip(), default_target)
    for item in filter(None, (s.strip() for s in rest.split(","))):
        key, colon, value = item.partition(":")
        if not colon:
            raise SystemExit(f"config {cfg.name}: {item!r} is not KEY:VALUE")
        if key == "url":
            cfg.target, cfg.url = "url", value
        elif key == "keep_sessions":
            cfg.keep_sessions = value.lower() in ("1", "true", "yes")
        elif key in ("target", "model", "mode", "interception", "policy"):
            setattr(cfg, key, value)
        else:
            raise SystemExit(f"config {cfg.name}: unknown key {key!r} (target, url, model, mode, interception, "
                             "policy, keep_sessions)")
    if cfg.target not in ("engine", "sim", "url") or (cfg.target == "url" and not cfg.url):
        raise SystemExit(f"config {cfg.name}: target must be engine, sim or url (with url:...)")
    if cfg.mode not in ("plain", "sessions", "auto"):
        raise SystemExit(f"config {cfg.name}: mode must be plain, sessions or auto")
    if cfg.mode == "auto" and cfg.target == "url":
        raise SystemExit(f"config {cfg.name}: on a URL, auto-continuation is the server's (auto_continue in its "
                         "config); drive it with mode:plain")
    return cfg


def add_arguments(p: argparse.ArgumentParser) -> None:
    from segue.bench.targets import add_sim_target_args
    from segue.sim.workloads.agents import add_agent_args

    g = p.add_argument_group("configurations")
    g.add_argument("--config", dest="configs", action="append", default=[], metavar="NAME=KEY:VALUE,...",
                   help="a configuration (repeatable). Keys: target (engine|sim|url), url, model, mode "
                        "(plain|sessions), interception, policy, keep_sessions")
    g.add_argument("--url", default=None, help="an OpenAI-compatible server (…/v1): runs --modes on it")
    g.add_argument("--modes", default="plain,sessions", help="with --url: which client modes (default: both)")
    g.add_argument("--served-model", dest="url_model", default=None,
                   help="with --url: the model name to send (default: --model, else the server's first model)")
    g.add_argument("--target", choices=["engine", "sim"], default="engine",
                   help="where configurations without a url or target run (default: engine)")
    g.add_argument("--api-key", default=None, help="bearer key for url targets")
    g.add_argument("--no-ignore-eos", action="store_true",
                   help="url targets: do not send ignore_eos (servers that reject it; turns may end early)")
    add_agent_args(p)
    add_sim_target_args(p)
    g.add_argument("--output-json", default=None, metavar="PATH", help="also write the results here as JSON")
    g.add_argument("--deadline-s", type=float, default=None, help="stop an engine/sim run after this long")


def configs_from_args(args: argparse.Namespace) -> list[AgentRunConfig]:
    texts = list(args.configs)
    if args.url:
        # With --url no engine is loaded here, so --model names the served model too.
        name = args.url_model or args.model
        model = f",model:{name}" if name else ""
        texts += [f"{m}=url:{args.url},mode:{m}{model}" for m in args.modes.split(",") if m]
    if not texts:
        texts = list(DEFAULT_CONFIGS)
    configs = [parse_agent_config(t, args.target) for t in texts]
    if len({c.name for c in configs}) != len(configs):
        raise SystemExit("configuration names must be distinct")
    return configs


def make_sim(args: argparse.Namespace, cfg: AgentRunConfig) -> Any:
    from segue.engine.args import engine_config_from_args
    from segue.sched.cost_model import PRESETS, CostModel
    from segue.sim.engine import default_kv_cache_tokens, make_sim_engine

    preset = args.preset
    cost = PRESETS[preset] if preset in PRESETS else CostModel.load(preset)
    config = engine_config_from_args(args)
    kv = args.sim_kv_cache_tokens or (default_kv_cache_tokens(preset, cost.kv_bytes_per_token, args.block_size)
                                      if preset in PRESETS else None) or args.kv_cache_tokens
    config.scheduler.max_num_batched_tokens = args.sim_max_num_batched_tokens or (
        cost.saturation_tokens if preset in PRESETS else args.max_num_batched_tokens)
    config.scheduler.interception_policy = cfg.interception or config.scheduler.interception_policy
    config.scheduler.policy = cfg.policy or config.scheduler.policy
    return make_sim_engine(cost, kv, config, max_model_len=args.max_model_len or 4096)


def run_config(args: argparse.Namespace, cfg: AgentRunConfig, runner: Any) -> dict[str, Any]:
    from segue.sim.workloads.agents import AgentSpec, draw_agents

    spec = AgentSpec.from_args(args)
    agents = draw_agents(spec)
    row: dict[str, Any] = {"config": cfg.name, "target": cfg.target, "mode": cfg.mode,
                           "interception": cfg.interception, "url": cfg.url}
    if cfg.target == "url":
        import asyncio

        from segue.bench.agent_client import drive_agents, turn_ttfts
        from segue.bench.client import ClientConfig

        client = ClientConfig(cfg.url or "", model=cfg.model, api_key=args.api_key,
                              ignore_eos=not args.no_ignore_eos, seed=spec.seed)
        res = asyncio.run(drive_agents(client, spec, agents, cfg.mode, cfg.keep_sessions))
        recs = res["records"]
        srv = res["server"]
        turns = [t for r in recs for t in r.turns]
        first, later, no_token = turn_ttfts(recs)
        hit = srv.get("prefix_hit_tokens")
        query = srv.get("prefix_query_tokens")
        modelled = srv.get("modelled_step_seconds")
        row.update(busy_s=[r.busy_s for r in recs], num_finished=len(recs), errors=res["errors"][:10],
                   wall_s=res["wall_s"], preemptions=srv.get("preemptions"),
                   recompute_gbs=srv.get("waste_recompute_gbs"),
                   waste_total_gbs=sum(v for k, v in srv.items() if k.startswith("waste_")) if any(
                       k.startswith("waste_") for k in srv) else None,
                   prefix_hit=hit / query if hit is not None and query else None,
                   # How much slower the server's steps ran than its profile charges them: what
                   # `segue sim --step-time-scale` needs to replay this run.
                   step_time_over_model=srv["step_seconds"] / modelled if modelled else None,
                   cached_share=sum(t.cached_tokens for t in turns) / max(1, sum(t.prompt_tokens for t in turns)),
                   computed_prompt_tokens=sum(t.prompt_tokens - t.cached_tokens for t in turns),
                   turn_ttft_mean=_mean([t.first_token - t.start for t in turns if t.first_token is not None]),
                   # A newcomer's wait (its agent's first turn) apart from later turns': the trade
                   # that protecting running agents' histories makes.
                   first_turn_ttft_s=first, later_turn_ttft_s=later, **ttft_fields(first, later, no_token),
                   turn_latency_mean=_mean([t.end - t.start for t in turns]),
                   turns=[[r.index, t.start - r.arrival, (t.first_token or t.end) - t.start, t.end - t.start,
                           t.prompt_tokens, t.cached_tokens, t.completion_tokens] for r in recs for t in r.turns],
                   server=srv)
    else:
        from segue.sim.agent_replay import run_agents
        from segue.sim.replay import real_clock_wait

        if cfg.target == "sim":
            engine = make_sim(args, cfg)
            wait = engine.clock.advance_to
        else:
            from segue.bench.targets import RunConfig

            engine = runner.make_engine(RunConfig(cfg.name, "engine", policy=cfg.policy,
                                                  interception=cfg.interception))
            wait = real_clock_wait
        res = run_agents(engine, spec, agents, cfg.mode, wait, deadline_s=args.deadline_s).to_dict()
        w = res["waste_gbs"]
        row.update(res, recompute_gbs=w.get("recompute_gbs"), waste_total_gbs=w.get("total_gbs"),
                   prefix_hit=res["prefix_hit_tokens"] / max(1, res["prefix_query_tokens"]))
    busy = row["busy_s"]
    row["mean_busy_s"] = sum(busy) / len(busy) if busy else None
    row["num_agents"] = len(agents)
    row["min_prompt_tokens"] = spec.min_prompt_tokens(agents)
    return row


def run(args: argparse.Namespace) -> int:
    from segue.bench.targets import Runner
    from segue.sim.workloads.agents import AgentSpec

    configs = configs_from_args(args)
    runner = Runner(args)
    rows = []
    for cfg in configs:
        rows.append(run_config(args, cfg, runner))
        r = rows[-1]
        scale = r.get("step_time_over_model")
        print(f"done: {cfg.name}: {r['num_finished']}/{r['num_agents']} agents, mean agent time - tool time "
              f"{_f(r['mean_busy_s'], '{:.2f}')} s, TTFT p90 first turns {_f(r.get('first_ttft_p90_s'), '{:.2f}')} s, "
              f"later turns {_f(r.get('later_ttft_p90_s'), '{:.2f}')} s"
              + (f"; server steps {scale:.2f}x what its profile charges" if scale else ""), file=sys.stderr, flush=True)
        for e in r.get("errors") or []:
            print(f"  error: {e}", file=sys.stderr)
    md = render(rows, f"segue bench agents — {AgentSpec.from_args(args).describe()}")
    print(md)
    if args.output_json:
        with open(args.output_json, "w", encoding="utf-8") as f:
            json.dump({"command": shlex.join([os.path.basename(sys.argv[0]) or "segue", *sys.argv[1:]]),
                       "workload": AgentSpec.from_args(args).__dict__, "rows": rows}, f, indent=1, default=str)
            f.write("\n")
    return 0


BENCHMARK = Benchmark(name="agents", help="agents with a shared system prompt, tools between turns, history "
                      "re-sent: plain vs sessions, on the engine, the simulator or any OpenAI URL",
                      add_arguments=add_arguments, run=run, description=__doc__)
