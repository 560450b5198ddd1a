"""`segue sim`: replay the InferCept trace on the real scheduler with a simulated A100-class
executor, sweeping arrival rates and interception policies (InferCept §5 at paper scale)."""
from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from typing import Any

from segue.config import SchedulerConfig
from segue.engine.args import add_newcomer_wait_arg
from segue.sched.interception import INTERCEPTION_POLICIES
from segue.sim.engine import default_kv_cache_tokens, step_limits

ALL_INTERCEPTION = "discard,improved-discard,preserve,swap,ttl,min-waste"


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def _policy_option(text: str) -> tuple[str, Any]:
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    try:
        return key.strip(), json.loads(value)
    except json.JSONDecodeError:
        return key.strip(), value


def _names(text: str) -> list[str]:
    names = [x.strip() for x in text.split(",") if x.strip()]
    unknown = [n for n in names if n not in INTERCEPTION_POLICIES]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown interception policies {unknown}; "
                                         f"choose from {sorted(INTERCEPTION_POLICIES)}")
    return names


def add_workload_args(p: argparse.ArgumentParser, num_requests_default: int | None) -> None:
    """Flags shared with `segue bench intercept`."""
    g = p.add_argument_group("workload")
    g.add_argument("--interception-policies", type=_names, default=_names(ALL_INTERCEPTION),
                   help=f"comma list (default: {ALL_INTERCEPTION})")
    g.add_argument("--rates", type=_floats, default=None,
                   help="comma list of arrival rates in req/s (default: sim 1,2,3,4,5; bench intercept 1)")
    g.add_argument("--num-requests", type=int, default=num_requests_default,
                   help="requests per run, drawn from the trace with replacement")
    g.add_argument("--arrival", choices=["poisson", "gamma"], default="poisson",
                   help="inter-arrival distribution (default: poisson)")
    g.add_argument("--cv", type=float, default=1.0, help="gamma arrivals' coefficient of variation")
    g.add_argument("--kinds", default=None, help="only these trace kinds (comma list of math, qa, ve, "
                   "chatbot, tts, image)")
    g.add_argument("--trace", default=None, help="InferCept trace JSON, plain or .gz (default: the packaged "
                   "merged_exp_uniform.json, or DIR/infercept/ when SEGUE_WORKLOADS=DIR)")
    g.add_argument("--seed", type=int, default=0, help="seeds request sampling, arrivals and token ids")
    g.add_argument("--latency-slo", type=float, default=0.5,
                   help="mean normalized latency (s/token) a sustainable rate must meet (default: 0.5)")
    g.add_argument("--output-json", default=None, metavar="PATH", help="also write the results here as JSON")
    g.add_argument("--no-progress", action="store_true", help="no progress bars on stderr")


def add_sim_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("simulated machine")
    g.add_argument("--preset", default="gptj-6b-a100",
                   help="gptj-6b-a100, vicuna-13b-2xa100 or a `segue profile` JSON path")
    g.add_argument("--step-time-scale", type=float, default=1.0,
                   help="run the preset's forward passes this many times slower (default: 1): a served "
                        "engine's steps over what its profile charges, from its /metrics "
                        "(segue_engine_step_seconds / segue_engine_modelled_step_seconds; `segue bench agents "
                        "--url` reports it)")
    g.add_argument("--kv-cache-tokens", type=int, default=None,
                   help="device KV pool in tokens (default for a preset: 0.9 of GPU memory minus fp16 weights)")
    g.add_argument("--gpu-memory-gib", type=float, default=80.0,
                   help="memory per GPU behind the preset's default KV pool (default: 80; InferCept's p4d: 40)")
    g.add_argument("--swap-space-tokens", type=int, default=None,
                   help="host KV pool in tokens (default: the server's for --workload agents, "
                        "else as large as the device pool)")
    g.add_argument("--block-size", type=int, default=16, help="tokens per KV cache block (default: 16)")
    g.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="token budget per step (default: the preset's saturation point; --workload agents: "
                        f"the server's, {SchedulerConfig.max_num_batched_tokens})")
    g.add_argument("--max-num-seqs", type=int, default=None,
                   help=f"sequences per step (default: 256, as vLLM; --workload agents: the server's, "
                        f"{SchedulerConfig.max_num_seqs})")
    g.add_argument("--watermark", type=float, default=SchedulerConfig.watermark,
                   help="fraction of the KV pool kept free when admitting new requests (default: 0)")
    g.add_argument("--no-agent-retention", action="store_true",
                   help="turn off agent-aware retention and admission (SchedulerConfig.agent_retention)")
    add_newcomer_wait_arg(g)
    g.add_argument("--oracle-predictions", action="store_true",
                   help="policies see each request's true segment lengths and pause durations")
    g.add_argument("--prediction-noise", type=float, default=0.0, metavar="SIGMA",
                   help="relative Gaussian noise on every prediction (LAMPS §6.4; default: 0)")
    g.add_argument("--max-model-len", type=int, default=4096,
                   help="context cap; 4096 keeps the trace's few 2048-2051-token requests (default: 4096)")
    g.add_argument("--policy", default="fcfs", help="ordering policy: fcfs, mlfq, ... (default: fcfs)")
    g.add_argument("--policy-option", type=_policy_option, action="append", default=[], metavar="KEY=VALUE",
                   help="an ordering-policy option (repeatable; VALUE is JSON, e.g. starvation_limit_s=2.0)")
    g.add_argument("--no-prefix-caching", action="store_true", help="do not reuse cached KV of shared prompt prefixes")
    add_workload_args(p, None)
    p.add_argument("--duration-s", type=float, default=600.0,
                   help="trace window: rate × duration requests per rate, unless --num-requests (default: 600)")
    p.add_argument("--plot", default=None, metavar="PATH", help="PNG of mean normalized latency vs rate")
    from segue.sim.workload_runs import add_sim_workload_args
    add_sim_workload_args(p)


def load_workload(args: argparse.Namespace, max_model_len: int) -> tuple[list[Any], int]:
    """The trace (filtered by kind) and how many requests were dropped for not fitting."""
    from segue.sim.workloads.infercept import fit_to_context, load_infercept

    trace = load_infercept(args.trace)
    if args.kinds:
        kinds = {k.strip() for k in args.kinds.split(",")}
        trace = [r for r in trace if r.kind in kinds]
    kept, dropped = fit_to_context(trace, max_model_len)
    if not kept:
        raise SystemExit("no trace request fits the context window")
    return kept, dropped


def draw(trace: list[Any], n: int, rate: float, seed: int, arrival: str = "poisson",
         cv: float = 1.0) -> tuple[list[Any], list[float]]:
    """The same requests (drawn with replacement) and arrivals for every policy at one rate; each
    rate has its own seeded draw."""
    import numpy as np

    from segue.sim.arrivals import ArrivalProcess

    rng = np.random.default_rng([seed, round(rate * 1000)])
    picks = rng.integers(0, len(trace), size=n)
    arrivals = ArrivalProcess(rate, arrival, cv).times(n, rng)  # type: ignore[arg-type]
    return [trace[int(i)] for i in picks], arrivals


def plot_latency_vs_rate(rows: list[dict[str, Any]], path: str, title: str) -> None:
    try:
        import matplotlib
    except ImportError:
        raise SystemExit("--plot needs matplotlib: pip install matplotlib") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from segue.sim.replay import row_metrics

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for policy in dict.fromkeys(r["policy"] for r in rows):
        measured = sorted((r["rate"], row_metrics(r)["norm_mean"]) for r in rows if r["policy"] == policy)
        pts = [(x, y) for x, y in measured if y is not None]
        ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", label=policy)
    ys = [y for y in (row_metrics(r)["norm_mean"] for r in rows) if y]
    if ys and max(ys) / min(ys) > 20:
        ax.set_yscale("log")  # one collapsing policy would otherwise flatten the rest
    ax.set_xlabel("arrival rate (req/s)")
    ax.set_ylabel("mean normalized latency (s/token)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run_sim(args: argparse.Namespace) -> int:
    from segue.config import CacheConfig, EngineConfig, PredictorConfig, SchedulerConfig
    from segue.executor.sim_executor import SimClock
    from segue.sched.cost_model import load_preset
    from segue.sim.engine import make_sim_engine
    from segue.sim.replay import render_markdown, replay

    if getattr(args, "workload", "infercept") != "infercept":
        from segue.sim.workload_runs import run_sim_workload
        return run_sim_workload(args)
    cost = load_preset(args.preset, args.step_time_scale)
    bs = args.block_size
    kv_tokens = args.kv_cache_tokens or default_kv_cache_tokens(args.preset, cost.kv_bytes_per_token, bs,
                                                                 args.gpu_memory_gib)
    if kv_tokens is None:
        raise SystemExit("--kv-cache-tokens is required with a profile JSON")
    swap_tokens = args.swap_space_tokens if args.swap_space_tokens is not None else kv_tokens
    batched, max_num_seqs = step_limits(args.max_num_batched_tokens, args.max_num_seqs, cost, serves=False)
    rates = args.rates or [1.0, 2.0, 3.0, 4.0, 5.0]
    trace, dropped = load_workload(args, args.max_model_len)
    progress = not args.no_progress
    rows: list[dict[str, Any]] = []
    sim_s = wall_s = 0.0
    steps = 0
    for rate in rates:
        n = args.num_requests or max(1, round(rate * args.duration_s))
        reqs, arrivals = draw(trace, n, rate, args.seed, args.arrival, args.cv)
        for name in args.interception_policies:
            config = EngineConfig(
                cache=CacheConfig(block_size=bs, kv_cache_tokens=kv_tokens, swap_space_tokens=swap_tokens,
                                  enable_prefix_caching=not args.no_prefix_caching),
                scheduler=SchedulerConfig(max_num_batched_tokens=batched, max_num_seqs=max_num_seqs,
                                          watermark=args.watermark,
                                          policy=args.policy, policy_options=dict(args.policy_option),
                                          interception_policy=name, agent_retention=not args.no_agent_retention,
                                          max_newcomer_wait_s=args.max_newcomer_wait_s),
                predictor=PredictorConfig(oracle=args.oracle_predictions, noise_sigma=args.prediction_noise))
            clock = SimClock()
            engine = make_sim_engine(cost, kv_tokens, config, max_model_len=args.max_model_len, clock=clock)
            res = replay(engine, reqs, arrivals, clock.advance_to, seed=args.seed, progress=progress,
                         desc=f"{name} @ {rate:g} req/s")
            rows.append({"policy": name, "rate": rate, **res.to_dict()})
            # The table comes at the end; a long sweep leaves each row in the log as it finishes.
            norm = (rows[-1].get("summary") or {}).get("normalized_latency", {}).get("mean")
            print(f"done: {name} @ {rate:g} req/s: {res.num_finished}/{len(reqs)} finished, mean normalized "
                  f"latency {norm if norm is not None else float('nan'):.3f} s/token, {res.wall_s:.0f} s wall",
                  file=sys.stderr, flush=True)
            sim_s += engine.clock()
            wall_s += res.wall_s
            steps += res.steps
    title = (f"segue sim — {args.preset}, {kv_tokens} KV tokens, {batched} tokens/step, "
             f"{args.policy} ordering")
    print(render_markdown(rows, args.latency_slo, title))
    speed = (f"simulated {sim_s:.0f} s in {wall_s:.1f} s wall ({sim_s / max(wall_s, 1e-9):.0f}× real time, "
             f"{steps / max(wall_s, 1e-9):.0f} steps/s); {dropped} trace requests dropped "
             f"(context ≥ {args.max_model_len})")
    print(f"\n{speed}")
    if args.output_json:
        result = {
            "command": shlex.join([os.path.basename(sys.argv[0]) or "segue", *sys.argv[1:]]),
            "preset": args.preset, "cost_model": cost.__dict__, "kv_cache_tokens": kv_tokens,
            "swap_space_tokens": swap_tokens, "max_num_batched_tokens": batched,
            "max_num_seqs": max_num_seqs, "watermark": args.watermark, "max_model_len": args.max_model_len,
            "policy": args.policy,
            "policy_options": dict(args.policy_option), "oracle_predictions": args.oracle_predictions,
            "prediction_noise": args.prediction_noise,
            "dropped_requests": dropped, "latency_slo": args.latency_slo, "sim_seconds": sim_s,
            "wall_seconds": wall_s, "rows": rows,
        }
        with open(args.output_json, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=2)
            f.write("\n")
    if args.plot:
        plot_latency_vs_rate(rows, args.plot, f"{args.preset}: InferCept trace")
    return 0


def main(argv: list[str] | None = None) -> int:
    # `python -m segue.sim ...` (see __main__.py), the same as `segue sim ...`.
    p = argparse.ArgumentParser(prog="segue sim", description=__doc__)
    add_sim_args(p)
    return run_sim(p.parse_args(argv))

