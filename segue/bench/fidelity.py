"""`segue bench fidelity`: does the simulator predict the real engine?

Runs one workload on the real in-process engine (wall clock), then the same requests and arrivals
in the simulator with the engine's measured cost model (`--profile PATH` from `segue profile`, or
profiled now; with `--profile-each-rate`, the mean of profiles taken right before and right after
each rate's run), with the same scheduler knobs and KV pool sizes; reports output throughput, mean
normalized latency and mean TTFT of both and their relative errors (target: within 10%).

To explain a miss it logs every real step and compares it with the cost model's prediction, split
into steps with a prefill and decode-only steps, and fits step time ≈ a·tokens + b + c·context over
the real steps; the simulator is then rerun with that fit ("refit"), showing how much of the error
the cost model's form explains. Timing on a shared machine is noisy; rerun before trusting a digit.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import tempfile
from typing import Any, cast

from segue.bench import Benchmark


def add_arguments(p: argparse.ArgumentParser) -> None:
    from segue.sim.workloads.registry import add_workload_args

    add_workload_args(p, num_requests=16)
    p.set_defaults(kinds="math,qa,ve")  # the kinds with sub-second pauses keep a real run short
    p.add_argument("--profile-repeats", type=int, default=3, help="repeats per point when profiling now")
    p.add_argument("--profile-each-rate", action="store_true",
                   help="profile right before and right after each rate's real run (without --profile) and simulate "
                        "with their mean: a VM whose speed drifts over minutes is measured at the speed the run saw, "
                        "and the drift between the two profiles is reported")
    p.add_argument("--tolerance", type=float, default=0.10, help="relative error called agreement (default 0.10)")
    p.add_argument("--deadline-s", type=float, default=None, help="stop the real run after this many seconds")
    p.add_argument("--output-json", default=None, metavar="PATH", help="also write the results here as JSON")
    p.add_argument("--no-progress", action="store_true", help="no progress bars on stderr")


DRIFT_TOKENS = (1, 16, 128, 512)


def drift(before: Any, after: Any) -> dict[int, float]:
    """How much slower (+) or faster (-) the machine ran a step of N tokens after a run than before."""
    return {n: after.t_fwd(n) / before.t_fwd(n) - 1 for n in DRIFT_TOKENS}


def _metrics(res: Any) -> dict[str, float | None]:
    from segue.bench.report import metric

    row = res.to_dict()
    return {"output_throughput": metric(row, "output_throughput", ""),
            "normalized_latency_mean": metric(row, "normalized_latency"),
            "ttft_mean": metric(row, "ttft"), "duration_s": res.duration_s, "steps": res.steps,
            "finished": res.num_finished}


def _error(sim: float | None, real: float | None) -> float | None:
    return None if sim is None or not real else (sim - real) / real


def step_diagnosis(log: Any, cost: Any) -> list[dict[str, Any]]:
    """Measured vs predicted time of the real steps, by kind of step."""
    rows = []
    for label, prefill in (("with prefill", True), ("decode only", False)):
        a = log.arrays(prefill)
        if not len(a["step_s"]):
            continue
        predicted = [cost.t_step(b, c, pairs, cold) for b, c, pairs, cold in
                     zip(a["batched_tokens"], a["context_tokens"], a["attended_pairs"], a["scattered_blocks"],
                         strict=True)]
        rows.append({"steps": label, "count": int(len(a["step_s"])),
                     "mean_batched_tokens": float(a["batched_tokens"].mean()),
                     "mean_context_tokens": float(a["context_tokens"].mean()),
                     "execute_ms": float(a["execute_s"].mean() * 1000), "step_ms": float(a["step_s"].mean() * 1000),
                     "predicted_ms": float(sum(predicted) / len(predicted) * 1000),
                     "total_step_s": float(a["step_s"].sum()), "total_predicted_s": float(sum(predicted))})
    return rows


def run(args: argparse.Namespace) -> int:
    from segue.bench.intercept import _warm_up
    from segue.bench.step_log import StepLog
    from segue.engine.args import engine_config_from_args
    from segue.engine.llm_engine import LLMEngine
    from segue.executor.loading import load_model
    from segue.executor.sim_executor import SimClock, SimExecutor
    from segue.sched.cost_model import CostModel, mean_cost_model
    from segue.sim.engine import make_sim_engine
    from segue.sim.replay import real_clock_wait, replay
    from segue.sim.workloads.registry import WorkloadSpec, arrivals_for, make_requests

    base = engine_config_from_args(args)
    executor, tokenizer, model_config, model_name, template = load_model(base)

    def engine_for(config: Any) -> LLMEngine:
        return LLMEngine(config, executor=executor, tokenizer=tokenizer, model_config=model_config,
                         model_name=model_name, chat_template=template)

    if args.profile_path and args.profile_each_rate:
        raise SystemExit("--profile-each-rate profiles now; it cannot be combined with --profile")

    def measure() -> tuple[Any, str]:
        if args.profile_path:
            return CostModel.load(args.profile_path), args.profile_path
        from segue.profiler.steps import profile

        pconf = copy.deepcopy(base)
        pconf.scheduler.max_num_batched_tokens = max(pconf.scheduler.max_num_batched_tokens, 1024)
        measured, _ = profile(engine_for(pconf), repeats=args.profile_repeats)
        return measured, "profiled before and after each rate" if args.profile_each_rate else "profiled now"

    def use(measured: Any) -> None:
        measured.kv_bytes_per_token = executor.kv_bytes_per_token
        measured.save(cost_path)

    cost, cost_source = measure()
    fd, cost_path = tempfile.mkstemp(prefix="segue-fidelity-", suffix=".json")
    os.close(fd)
    use(cost)
    config = copy.deepcopy(base)
    config.scheduler.profile_path = cost_path  # the real scheduler plans with the costs the simulator charges
    probe = engine_for(config)
    _warm_up(probe)
    spec = WorkloadSpec.from_args(args)
    try:
        requests, dropped = make_requests(spec, probe.max_model_len)
    except (FileNotFoundError, ValueError) as e:
        raise SystemExit(str(e)) from None
    bs = executor.block_size
    kv_tokens, swap_tokens = executor.num_device_blocks * bs, executor.num_host_blocks * bs
    report: dict[str, Any] = {"workload": spec.describe(), "cost_model": cost.__dict__, "cost_source": cost_source,
                              "model": probe.model_name, "device": getattr(executor, "device_name", "cpu"),
                              "kv_cache_tokens": kv_tokens, "dropped": dropped, "runs": []}
    try:
        after = None
        for rate in args.rates:
            if after is not None:
                cost = after  # taken right after the previous rate: right before this one
                use(cost)
            arrivals = arrivals_for(spec, rate)
            engine = engine_for(copy.deepcopy(config))
            log = StepLog()
            log.attach(engine, cost.prefetch_warmup_blocks)
            real = replay(engine, requests, arrivals, real_clock_wait, seed=args.seed, progress=not args.no_progress,
                          desc=f"real @ {rate:g} req/s", deadline_s=args.deadline_s)
            per_token, base_ms, per_ctx = log.fit()
            refit = CostModel(fwd_ms_per_token=per_token, fwd_base_ms=base_ms, fwd_ms_per_context_token=per_ctx,
                              saturation_tokens=cost.saturation_tokens, swap_bytes_per_s=cost.swap_bytes_per_s,
                              kv_bytes_per_token=cost.kv_bytes_per_token, device=cost.device, source="refit")
            run: dict[str, Any] = {"rate": rate, "cost_model": cost.__dict__, "real": _metrics(real),
                                   "real_busy_s": sum(s.step_s for s in log.samples),
                                   "steps": step_diagnosis(log, cost), "refit_cost_model": refit.__dict__}
            models = [("sim", cost), ("refit", refit)]
            if args.profile_each_rate:
                after, _ = measure()
                around = mean_cost_model(cost, after, "mean of the profiles before and after the run")
                run.update(cost_model_after=after.__dict__, cost_model=around.__dict__, drift=drift(cost, after))
                models = [("sim", around), ("sim_before", cost), ("refit", refit)]
            for name, model in models:
                sconf = copy.deepcopy(config)
                sconf.scheduler.profile_path = None
                clock = SimClock()
                sim_engine = make_sim_engine(model, kv_tokens, sconf, max_model_len=probe.max_model_len,
                                             swap_space_tokens=swap_tokens, clock=clock)
                res = replay(sim_engine, requests, arrivals, clock.advance_to, seed=args.seed)
                m = _metrics(res)
                run[name] = m
                run[f"{name}_busy_s"] = cast(SimExecutor, sim_engine.executor).busy_seconds
                run[f"{name}_error"] = {k: _error(m[k], run["real"][k])
                                        for k in ("output_throughput", "normalized_latency_mean", "ttft_mean")}
            report["runs"].append(run)
    finally:
        os.unlink(cost_path)
    print(render(report, args.tolerance))
    if args.output_json:
        with open(args.output_json, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=2)
            f.write("\n")
    return 0


def _pct(v: float | None) -> str:
    return "n/a" if v is None else f"{v:+.1%}"


def _num(v: float | None, fmt: str = "{:.4f}") -> str:
    return "n/a" if v is None else fmt.format(v)


def _cost_text(c: dict[str, Any]) -> str:
    if c.get("fwd_curve_ms"):
        own = "f(tokens), f in ms at {" + ", ".join(f"{t:g}: {ms:.1f}" for t, ms in c["fwd_curve_ms"]) + "},"
    else:
        own = f"{c['fwd_ms_per_token']:.4f} ms/token + {c['fwd_base_ms']:.1f} ms"
    return f"T_fwd = {own} + {c['fwd_ms_per_context_token']:.5f} ms/context token"


def render(report: dict[str, Any], tolerance: float) -> str:
    lines = ["## segue bench fidelity — real engine vs simulator", "",
             f"{report['model']} on {report['device']}, {report['kv_cache_tokens']} KV tokens; workload: "
             f"{report['workload']}. Cost model ({report['cost_source']}): {_cost_text(report['cost_model'])}.", ""]
    for run in report["runs"]:
        real, sim, refit = run["real"], run["sim"], run["refit"]
        lines += [f"### {run['rate']:g} req/s", ""]
        if "drift" in run:
            moved = ", ".join(f"{n} tokens {run['drift'][n]:+.1%}" for n in DRIFT_TOKENS)
            lines += [f"Profiled before and after this rate; the simulator charges their mean, "
                      f"{_cost_text(run['cost_model'])}. Step time after the run against before: {moved}.", ""]
        elif run.get("cost_model", report["cost_model"]) != report["cost_model"]:
            lines += [f"Profiled right before this rate: {_cost_text(run['cost_model'])}.", ""]
        lines += ["| | real | sim | error | sim (refit) | error |", "|---|---:|---:|---:|---:|---:|"]
        for key, label, fmt in (("output_throughput", "output tok/s", "{:.1f}"),
                                ("normalized_latency_mean", "mean normalized latency (s/token)", "{:.4f}"),
                                ("ttft_mean", "mean TTFT (s)", "{:.3f}")):
            lines.append(f"| {label} | {_num(real[key], fmt)} | {_num(sim[key], fmt)} | "
                         f"{_pct(run['sim_error'][key])} | {_num(refit[key], fmt)} | {_pct(run['refit_error'][key])} |")
        lines.append(f"| busy time (s) | {run['real_busy_s']:.1f} | {run['sim_busy_s']:.1f} | "
                     f"{_pct(_error(run['sim_busy_s'], run['real_busy_s']))} | {run['refit_busy_s']:.1f} | "
                     f"{_pct(_error(run['refit_busy_s'], run['real_busy_s']))} |")
        lines.append(f"| steps | {real['steps']} | {sim['steps']} | | {refit['steps']} | |")
        lines.append(f"| requests finished | {real['finished']} | {sim['finished']} | | {refit['finished']} | |")
        if "sim_before" in run:
            b = run["sim_before_error"]
            lines.append(f"| with the profile before the run only | | | {_pct(b['output_throughput'])} thr., "
                         f"{_pct(b['normalized_latency_mean'])} norm. | | |")
        worst = max(abs(run["sim_error"][k] or 0) for k in ("output_throughput", "normalized_latency_mean"))
        lines += ["", f"Agreement within {tolerance:.0%} on throughput and mean normalized latency: "
                      f"{'yes' if worst <= tolerance else 'no'} (worst {worst:.1%})."]
        if real["finished"] < sim["finished"]:
            lines.append("**The real run stopped at its deadline with requests unfinished: the two runs did not "
                         "do the same work, so these errors are not a fidelity measurement.**")
        lines += ["",
                  "Real steps against the cost model's prediction:", "",
                  "| steps | count | mean tokens | mean context | forward (ms) | whole step (ms) | predicted (ms) |",
                  "|---|---:|---:|---:|---:|---:|---:|"]
        for s in run["steps"]:
            lines.append(f"| {s['steps']} | {s['count']} | {s['mean_batched_tokens']:.0f} "
                         f"| {s['mean_context_tokens']:.0f} | {s['execute_ms']:.1f} | {s['step_ms']:.1f} "
                         f"| {s['predicted_ms']:.1f} |")
        r = run["refit_cost_model"]
        lines += ["", f"Refit over the real steps: {r['fwd_ms_per_token']:.4f} ms/token + {r['fwd_base_ms']:.1f} ms "
                      f"+ {r['fwd_ms_per_context_token']:.5f} ms/context token.", ""]
    return "\n".join(lines)


BENCHMARK = Benchmark(
    name="fidelity",
    help="one workload on the real engine and in the simulator with its measured cost model; the error",
    add_arguments=add_arguments,
    run=run,
    description=__doc__,
)
