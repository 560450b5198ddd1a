"""The `segue` command: serve | generate | profile | sim | bench."""
from __future__ import annotations

import argparse
import logging
import os
import sys

from segue.cluster import DEFAULT_ENGINE_RESTARTS
from segue.config import ConfigError
from segue.engine.args import add_engine_args, engine_config_from_args
from segue.server.launch import DEFAULT_KEEP_ALIVE_S


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=256, help="tokens to generate at most (default: 256)")
    g.add_argument("--temperature", type=float, default=0.0, help="sampling temperature; 0 is greedy (default: 0)")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default: 1, off)")
    g.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens (default: 0, off)")
    g.add_argument("--seed", type=int, default=None, help="per-request sampling seed (default: unseeded)")
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")


def cmd_generate(args: argparse.Namespace) -> int:
    from segue.engine.llm import LLM
    from segue.sampling_params import SamplingParams

    llm = LLM(config=engine_config_from_args(args))
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.seed, stop=args.stop)
    if args.raw or not llm.engine.chat_template:
        prompt = args.prompt
    else:
        messages = ([{"role": "system", "content": args.system}] if args.system else [])
        prompt = llm.engine.apply_chat_template(messages + [{"role": "user", "content": args.prompt}])
    out = llm.generate(prompt, params)[0]
    print(out.outputs[0].text)
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from segue.model.table_cache import RECHECK_ENV
    from segue.server.launch import run_server

    # A server re-checks, in the background, measured tables timed while its CPUs were taken
    # (segue/model/table_cache.py); benchmarks and tests never time beside such a check.
    os.environ.setdefault(RECHECK_ENV, "1")
    return run_server(engine_config_from_args(args), args)


def cmd_profile(args: argparse.Namespace) -> int:
    from segue.engine.llm_engine import LLMEngine
    from segue.executor.loading import profile_key, profile_path
    from segue.profiler import steps as profiler

    config = engine_config_from_args(args)
    config.scheduler.max_num_batched_tokens = max(config.scheduler.max_num_batched_tokens, 1024)
    engine = LLMEngine(config)
    grid = {"cpu": profiler.CPU_GRID, "cuda": profiler.CUDA_GRID, "tiny": profiler.TINY_GRID}.get(args.grid)
    cost, report = profiler.profile(engine, repeats=args.repeats, grid=grid, timer=args.timer)
    key = profile_key(config, engine.executor)
    path = args.output or profile_path(key)
    profiler.save_profile(path, cost, report, key)
    fit = report.fit
    print("| step | tokens | context | attended pairs | seqs | measured (ms) | fit (ms) | error |\n"
          "|---|---:|---:|---:|---:|---:|---:|---:|")
    for p in report.points:
        pred = fit.predict_ms(p.batched_tokens, p.context_tokens, pairs=p.attended_pairs)
        ms = p.step_ms if args.timer == "wall" else p.cpu_ms
        print(f"| {p.kind} | {p.batched_tokens} | {p.context_tokens} | {p.attended_pairs} | {p.num_seqs} "
              f"| {ms:.1f} | {pred:.1f} | {(pred - ms) / ms:+.0%} |")
    per_kind = "; ".join(f"{k} {r['mean_rel_error']:+.1%} (worst {r['max_abs_rel_error']:.0%})"
                         for k, r in fit.residuals.items())
    curve = ", ".join(f"{t:g}: {ms:.1f}" for t, ms in cost.fwd_curve_ms or [])
    line = report.line_fit
    print(f"\nstep = f(tokens) + {cost.fwd_ms_per_context_token:.5f} ms * context tokens + "
          f"{cost.fwd_ms_per_attended_pair * 1e6:.2f} ns * attended pairs, f in ms at {{{curve}}} "
          f"(R^2 {fit.r2:.3f}; mean |error| {fit.mean_abs_rel_error:.1%}; by kind: {per_kind})"
          f"\na line instead: {line.ms_per_token:.4f} ms * tokens + {line.base_ms:.1f} ms + "
          f"{line.ms_per_context_token:.5f} ms * context (mean |error| {line.mean_abs_rel_error:.1%})"
          f"\nsaturation point {cost.saturation_tokens} tokens; swap {cost.swap_bytes_per_s / 1e9:.2f} GB/s; "
          f"{cost.kv_bytes_per_token} KV bytes/token; measured in {report.seconds:.0f} s ({args.timer} time; "
          f"wall/CPU time {report.to_dict()['wall_over_cpu_median'] or 0:.2f}: >1 means other processes "
          f"slowed the steps)\nwrote {path}")
    d = report.per_seq_fit
    print(f"with a per-sequence term the fit would be {d.ms_per_token:.4f} ms * tokens + {d.base_ms:.1f} ms + "
          f"{d.ms_per_context_token:.5f} ms * context + {d.ms_per_seq:.2f} ms * seqs: mean |error| "
          f"{d.mean_abs_rel_error:.1%} (the CostModel has no such term)")
    if report.scatter:
        print(report.scatter.describe())
    if report.overlap:
        print(report.overlap.describe())
    for why in report.skipped:
        print(f"skipped {why}")
    return 0


def cmd_sim(args: argparse.Namespace) -> int:
    from segue.sim.run import run_sim

    return run_sim(args)


def cmd_bench(args: argparse.Namespace) -> int:
    from segue.bench import run_bench

    return run_bench(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="segue", description=__doc__)
    parser.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING or ERROR (default: INFO)")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="apply the chat template to a prompt and print the answer")
    gen.add_argument("prompt")
    gen.add_argument("--system", default=None, help="optional system message")
    gen.add_argument("--raw", action="store_true", help="send the prompt as is, without the chat template")
    add_engine_args(gen)
    add_sampling_args(gen)
    gen.set_defaults(func=cmd_generate)

    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    serve.add_argument("--port", type=int, default=8000, help="port to listen on (default: 8000)")
    serve.add_argument("--config", default=None, help="server config file (JSON or TOML): limits, sessions, "
                       "API keys, server-side tools; see segue/server/README.md")
    serve.add_argument("--api-key", action="append", default=None,
                       help="accepted API key (repeatable; also SEGUE_API_KEYS, comma separated)")
    serve.add_argument("--engines", type=int, default=1, help="engine replicas; more than one run as Ray "
                       "actors on a local Ray instance (see segue/cluster)")
    serve.add_argument("--router", default="affinity", choices=["affinity", "round_robin"],
                       help="how requests are placed on replicas when --engines > 1")
    serve.add_argument("--engine-restarts", type=int, default=DEFAULT_ENGINE_RESTARTS,
                       help="when --engines > 1: how many times Ray restarts a crashed engine replica "
                       "(rebuilding its engine) before it stays down; 0 disables restarts")
    serve.add_argument("--timeout-keep-alive", type=int, default=DEFAULT_KEEP_ALIVE_S, metavar="SECONDS",
                       help="how long an idle HTTP connection stays open; keep it above your clients' "
                       f"keep-alive expiry (default: {DEFAULT_KEEP_ALIVE_S})")
    add_engine_args(serve)
    serve.set_defaults(func=cmd_serve)

    prof = sub.add_parser("profile", help="measure T_fwd, the saturation point and swap bandwidth")
    prof.add_argument("--output", default=None,
                      help="profile JSON (default: the one the engine looks for, keyed by this machine, model and "
                      "threads: profiles/profile-<device>-<key>.json under $SEGUE_CACHE_DIR or ~/.cache/segue)")
    prof.add_argument("--repeats", type=int, default=None, help="repeats per prefill size (default: the grid's)")
    prof.add_argument("--grid", default="auto", choices=["auto", "cpu", "cuda", "tiny"],
                      help="which steps to time (auto: by device; see segue/profiler/steps.py)")
    prof.add_argument("--timer", default="wall", choices=["wall", "cpu"],
                      help="fit wall-clock step time (default) or process CPU time (one-thread CPU engine on a "
                      "shared machine: the steps' own cost without others' load)")
    add_engine_args(prof)
    prof.set_defaults(func=cmd_profile)

    from segue.sim.run import add_sim_args
    sim = sub.add_parser("sim", help="the real scheduler on a simulated executor at paper scale")
    add_sim_args(sim)
    sim.set_defaults(func=cmd_sim)

    bench = sub.add_parser("bench", help="benchmarks (see BENCHMARKS.md)")
    from segue.bench import add_bench_subparsers
    add_bench_subparsers(bench, add_engine_args)
    bench.set_defaults(func=cmd_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except ConfigError as e:  # a bad flag value: say which, as argparse does, without a traceback
        parser.exit(2, f"segue {args.command}: error: {e}\n")


if __name__ == "__main__":
    sys.exit(main())
