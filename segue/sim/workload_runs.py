"""`segue sim --workload agents | chain | map-reduce`: workloads other than the InferCept trace on
the simulated executor (the same scheduler, KV manager and policies as the real engine).

- agents (workloads/agents.py): plain clients vs sessions under each --interception-policies;
- chain, map-reduce (program_sim.py): Parrot's program-aware execution vs the request-centric
  baseline, for each --program-output-tokens;
- mooncake (mooncake_run.py): prefix-cache hit rate against capacity, LRU vs Segue's eviction,
  and latency at the preset.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from typing import Any

SIM_WORKLOADS = ("infercept", "agents", "chain", "map-reduce", "mooncake")


def add_sim_workload_args(p: argparse.ArgumentParser) -> None:
    from segue.sim.mooncake_run import add_mooncake_args
    from segue.sim.workloads.agents import add_agent_args

    p.add_argument("--workload", choices=SIM_WORKLOADS, default="infercept",
                   help="infercept (the trace, default), agents (shared system prompt, multi-turn, tools), "
                        "chain or map-reduce (Parrot's programs vs request-centric clients), "
                        "mooncake (prefix-cache hit rate against capacity on the Mooncake traces)")
    add_mooncake_args(p)
    p.add_argument("--prefix-eviction", choices=("lru", "reuse"), default="lru",
                   help="agents, chain, map-reduce: eviction order of finished requests' cached blocks "
                        "(SchedulerConfig.prefix_eviction; default: lru; mooncake runs both)")
    add_agent_args(p, seed=False)
    p.add_argument("--agent-modes", default="plain,sessions,auto",
                   help="agents: client modes to run (plain once; sessions and auto under each "
                        "--interception-policies; default: plain,sessions,auto)")
    g = p.add_argument_group("programs (chain, map-reduce)")
    g.add_argument("--program-chunks", type=int, default=20, help="document chunks (default: 20)")
    g.add_argument("--chunk-tokens", type=int, default=1024, help="tokens per chunk (default: 1024)")
    g.add_argument("--program-output-tokens", default="25,50,100",
                   help="comma list of output tokens per call (default: 25,50,100)")
    g.add_argument("--rtt-s", type=float, default=0.25, help="client-server round trip (default: 0.25 s, "
                   "Parrot's 200-300 ms)")
    g.add_argument("--latency-capacity-tokens", type=int, default=4096,
                   help="running tokens while latency-sensitive requests run (Parrot's baseline: 4096)")


def _engine(args: argparse.Namespace, interception: str | None = None, prefix_caching: bool = True,
            latency_capacity: int | None = None, prefix_eviction: str = "lru") -> Any:
    from segue.config import CacheConfig, EngineConfig, SchedulerConfig
    from segue.sched.cost_model import load_preset
    from segue.sim.engine import default_kv_cache_tokens, make_sim_engine, step_limits

    cost = load_preset(args.preset, args.step_time_scale)
    kv = args.kv_cache_tokens or default_kv_cache_tokens(args.preset, cost.kv_bytes_per_token, args.block_size,
                                                         args.gpu_memory_gib)
    if kv is None:
        raise SystemExit("--kv-cache-tokens is required with a profile JSON")
    # The agents workload is replayed against `segue serve` with the same flags (segue bench
    # agents), so what they leave unsaid is the server's default: its host tier, not the device
    # pool's size (with 8,192 device tokens that hid most of the write-backs the server makes), and
    # its step budget and sequence limit, not the preset's saturation point and vLLM's 256 (with a
    # 512-token budget the simulator chunked prompts the server prefills in one step, and starved
    # newcomers on a seed where the server let every one in within 9 s; BENCHMARKS.md).
    serves = args.workload == "agents"
    host = args.swap_space_tokens
    if host is None:
        host = CacheConfig.swap_space_tokens if serves else kv
    budget, max_num_seqs = step_limits(args.max_num_batched_tokens, args.max_num_seqs, cost, serves)
    config = EngineConfig(
        cache=CacheConfig(block_size=args.block_size, kv_cache_tokens=kv, swap_space_tokens=host,
                          enable_prefix_caching=prefix_caching and not args.no_prefix_caching),
        scheduler=SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_num_seqs,
                                  watermark=args.watermark, policy=args.policy,
                                  policy_options=dict(args.policy_option), latency_capacity_tokens=latency_capacity,
                                  interception_policy=interception or "min-waste",
                                  prefix_eviction=prefix_eviction,
                                  agent_retention=not args.no_agent_retention,
                                  max_newcomer_wait_s=args.max_newcomer_wait_s))
    return make_sim_engine(cost, kv, config, max_model_len=args.max_model_len)


def _agents(args: argparse.Namespace) -> tuple[list[dict[str, Any]], str]:
    from segue.sim.agent_replay import run_agents
    from segue.sim.agent_report import render
    from segue.sim.workloads.agents import AgentSpec, draw_agents

    spec = AgentSpec.from_args(args)
    agents = draw_agents(spec)
    rows = []
    modes = [m.strip() for m in args.agent_modes.split(",") if m.strip()]
    configs = ([("plain", None)] if "plain" in modes else []) + [
        (m, p) for m in ("sessions", "auto") if m in modes for p in args.interception_policies]
    for mode, policy in configs:
        engine = _engine(args, policy, prefix_eviction=args.prefix_eviction)
        res = run_agents(engine, spec, agents, mode, engine.clock.advance_to).to_dict()
        busy = res["busy_s"]
        rows.append({**res, "config": mode if policy is None else f"{mode}-{policy}", "target": "sim",
                     "mode": mode, "interception": policy, "num_agents": len(agents),
                     "mean_busy_s": sum(busy) / len(busy) if busy else None,
                     "recompute_gbs": res["waste_gbs"]["recompute_gbs"],
                     "waste_total_gbs": res["waste_gbs"]["total_gbs"],
                     "prefix_hit": res["prefix_hit_tokens"] / max(1, res["prefix_query_tokens"]),
                     "min_prompt_tokens": spec.min_prompt_tokens(agents)})
    return rows, render(rows, f"segue sim --workload agents — {args.preset}: {spec.describe()}")


def _programs(args: argparse.Namespace) -> tuple[list[dict[str, Any]], str]:
    from segue.sim.programs import ProgramSpec, run_program

    rows = []
    for n in [int(x) for x in args.program_output_tokens.split(",") if x.strip()]:
        spec = ProgramSpec(args.workload, args.program_chunks, args.chunk_tokens, n, rtt_s=args.rtt_s, seed=args.seed)
        row: dict[str, Any] = {"workload": args.workload, "output_tokens": n}
        for aware in (False, True):
            engine = _engine(args, prefix_caching=aware, latency_capacity=args.latency_capacity_tokens)
            row["program" if aware else "baseline"] = run_program(engine, spec, aware, engine.clock.advance_to)
        row["speedup"] = row["baseline"]["e2e_s"] / row["program"]["e2e_s"]
        rows.append(row)
    lines = [f"### segue sim --workload {args.workload} — {args.preset}, {args.program_chunks} chunks × "
             f"{args.chunk_tokens} tokens, round trip {args.rtt_s:g} s, latency capacity "
             f"{args.latency_capacity_tokens} tokens", "",
             "| output tokens per call | request-centric (s) | program-aware (s) | speedup |", "|---:|---:|---:|---:|"]
    lines += [f"| {r['output_tokens']} | {r['baseline']['e2e_s']:.2f} | {r['program']['e2e_s']:.2f} | "
              f"**{r['speedup']:.2f}×** |" for r in rows]
    return rows, "\n".join(lines)


def run_sim_workload(args: argparse.Namespace) -> int:
    if args.workload == "mooncake":
        from segue.sim.mooncake_run import run_mooncake

        result, md = run_mooncake(args, lambda eviction: _engine(args, prefix_eviction=eviction))
        rows: Any = result
    else:
        rows, md = _agents(args) if args.workload == "agents" else _programs(args)
    print(md)
    if args.output_json:
        with open(args.output_json, "w", encoding="utf-8") as f:
            json.dump({"command": shlex.join([os.path.basename(sys.argv[0]) or "segue", *sys.argv[1:]]),
                       "preset": args.preset, "rows": rows}, f, indent=1, default=str)
            f.write("\n")
    return 0
