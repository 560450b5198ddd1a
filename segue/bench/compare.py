"""`segue bench compare`: several configurations on the same generated workload, in one run.

Each configuration is the simulator or the in-process engine with a scheduling and interception
policy, or an OpenAI-compatible URL (a Segue server, or a peer such as vLLM). Every configuration
sees the same requests and, per rate, the same arrival times. Writes compare.json (with every
request's record), compare.md (the table, and ratios to the first configuration) and two PNGs.

  segue bench compare --workload infercept --rates 1,2,4 \\
      --config fcfs=policy:fcfs,interception:discard --config mw=policy:fcfs,interception:min-waste
  segue bench compare --workload throughput --rates 0.5,1 --num-requests 32 \\
      --url http://127.0.0.1:8000/v1 --url http://127.0.0.1:8765/v1
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from segue.bench import Benchmark


def add_arguments(p: argparse.ArgumentParser) -> None:
    from segue.bench.targets import add_sim_target_args
    from segue.sim.workloads.registry import add_workload_args

    g = p.add_argument_group("configurations")
    g.add_argument("--config", dest="configs", action="append", default=[], metavar="NAME=KEY:VALUE,...",
                   help="a configuration to run (repeatable; the first is the baseline of the ratios). Keys: "
                        "target (sim|engine), url, model, policy, interception, opt.NAME")
    g.add_argument("--url", dest="urls", action="append", default=[],
                   help="an OpenAI-compatible server to drive, e.g. http://127.0.0.1:8765/v1 (repeatable)")
    g.add_argument("--target", choices=["sim", "engine"], default="sim",
                   help="where configurations without a url or target run (default: sim)")
    g.add_argument("--api-key", default=None, help="bearer key for url targets")
    g.add_argument("--plain-openai", action="store_true",
                   help="url targets: send only standard OpenAI fields (no ignore_eos, program_id, sessions), "
                        "for servers that reject unknown fields; output lengths then depend on EOS")
    add_workload_args(p)
    add_sim_target_args(p)
    o = p.add_argument_group("output")
    o.add_argument("--output-dir", default=None,
                   help="where compare.json, compare.md and the PNGs go (default: results/compare-<time>)")
    o.add_argument("--latency-slo", type=float, default=None,
                   help="also report each configuration's max rate with mean normalized latency ≤ this (s/token)")
    o.add_argument("--deadline-s", type=float, default=None,
                   help="stop a run this many seconds after it starts (unfinished requests are reported)")
    o.add_argument("--no-plots", action="store_true", help="write compare.json and compare.md only")
    o.add_argument("--no-progress", action="store_true", help="no progress bars on stderr")


def configs_from_args(args: argparse.Namespace) -> list[Any]:
    from segue.bench.targets import RunConfig, parse_config

    configs = [parse_config(c, args.target) for c in args.configs]
    for url in args.urls:
        host = urlparse(url).netloc or url
        configs.append(RunConfig(host, "url", url=url))
    if not configs:
        raise SystemExit("nothing to compare: give --config NAME=... and/or --url URL")
    names = [c.name for c in configs]
    if len(set(names)) != len(names):
        raise SystemExit(f"configuration names must be distinct: {names}")
    return configs


def run(args: argparse.Namespace) -> int:
    from segue.bench.report import render
    from segue.bench.targets import Runner
    from segue.sim.workloads.registry import WorkloadSpec, arrivals_for, make_requests

    configs = configs_from_args(args)
    runner = Runner(args)
    spec = WorkloadSpec.from_args(args)
    max_len = runner.max_model_len(configs)
    try:
        requests, dropped = make_requests(spec, max_len)
    except (FileNotFoundError, ValueError) as e:
        raise SystemExit(str(e)) from None
    if dropped:
        print(f"{dropped} trace requests left out: their context reaches {max_len} tokens", file=sys.stderr)
    rows: list[dict[str, Any]] = []
    for rate in args.rates:
        arrivals = arrivals_for(spec, rate)
        for cfg in configs:
            rows.append(runner.run(cfg, requests, arrivals, rate, progress=not args.no_progress))
    title = f"segue bench compare — {len(configs)} configurations"
    md = render(rows, title, spec.describe(), args.latency_slo)
    print(md)
    out = Path(args.output_dir or f"results/compare-{time.strftime('%Y%m%d-%H%M%S')}")
    out.mkdir(parents=True, exist_ok=True)
    result = {
        "command": shlex.join([os.path.basename(sys.argv[0]) or "segue", *sys.argv[1:]]),
        "workload": {**spec.__dict__, "rates": args.rates, "max_model_len": max_len, "dropped": dropped},
        "configs": [c.__dict__ for c in configs],
        "sim_cost_model": runner.sim_cost().__dict__ if any(c.target == "sim" for c in configs) else None,
        "record_fields": ["arrival_time", "first_token_time", "finish_time", "prompt_tokens", "output_tokens",
                          "intercepted_time"],
        "rows": rows,
    }
    (out / "compare.json").write_text(json.dumps(result, indent=1) + "\n")
    (out / "compare.md").write_text(md + "\n")
    if not args.no_plots:
        from segue.bench.plots import latency_cdfs, latency_vs_rate

        latency_vs_rate(rows, out / "latency_vs_rate.png", spec.describe())
        latency_cdfs(rows, out / "latency_cdf.png", spec.describe())
    plots = "" if args.no_plots else ", latency_vs_rate.png, latency_cdf.png"
    print(f"\nwrote {out}/compare.json, compare.md{plots}", file=sys.stderr)
    return 0


BENCHMARK = Benchmark(
    name="compare",
    help="run several configurations (simulator, in-process engine, URLs) on one workload and compare",
    add_arguments=add_arguments,
    run=run,
    description=__doc__,
)
