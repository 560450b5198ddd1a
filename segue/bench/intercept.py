"""`segue bench intercept`: the InferCept trace replayed open-loop on the real engine, per
interception policy and arrival rate, on the wall clock (tool and human pauses really elapse).

The simulator (`segue sim`) runs the same driver and table at paper scale; this benchmark is the
small-scale check that the two agree. Heavy imports stay inside functions (see segue/bench)."""
from __future__ import annotations

import argparse
import copy
import json
import os
import shlex
import sys
from typing import Any

from segue.bench import Benchmark


def add_arguments(p: argparse.ArgumentParser) -> None:
    from segue.sim.run import add_workload_args

    # Engine flags (--kv-cache-tokens, default 16384, and the rest) come from the bench parser;
    # --interception-policies here overrides the engine's single --interception-policy.
    add_workload_args(p, num_requests_default=24)
    p.add_argument("--deadline-s", type=float, default=None,
                   help="stop a run this many seconds after its first arrival (unfinished requests are "
                        "reported; default: run until all finish)")


def _warm_up(engine: Any) -> None:
    """One tiny request so one-off costs (kernel build, allocator growth) stay out of the runs."""
    from segue.engine.engine_request import EngineRequest
    from segue.sampling_params import SamplingParams

    lo = 1000 if engine.model_config.vocab_size > 4000 else 0
    warmup = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    engine.add_request(EngineRequest(list(range(lo, lo + 16)), warmup, "warmup"))
    while engine.has_unfinished_requests():
        engine.step()


def run(args: argparse.Namespace) -> int:
    from segue.engine.args import engine_config_from_args
    from segue.engine.llm_engine import LLMEngine
    from segue.executor.loading import load_model
    from segue.sim.replay import real_clock_wait, render_markdown, replay
    from segue.sim.run import draw, load_workload

    base = engine_config_from_args(args)
    # Load the model once; every (policy, rate) run gets a fresh engine (scheduler, KV manager,
    # statistics) over the same executor, whose stale KV contents no block table points at.
    loaded = load_model(base)
    executor, tokenizer, model_config, model_name, chat_template = loaded

    def make_engine(policy: str) -> LLMEngine:
        config = copy.deepcopy(base)
        config.scheduler.interception_policy = policy
        return LLMEngine(config, executor=executor, tokenizer=tokenizer, model_config=model_config,
                         model_name=model_name, chat_template=chat_template)

    probe = make_engine(args.interception_policies[0])
    _warm_up(probe)
    trace, dropped = load_workload(args, probe.max_model_len)
    if dropped:
        print(f"dropped {dropped} trace requests whose context reaches the engine's max_model_len "
              f"({probe.max_model_len})", file=sys.stderr)
    rates = args.rates or [1.0]
    rows: list[dict[str, Any]] = []
    for rate in rates:
        reqs, arrivals = draw(trace, args.num_requests, rate, args.seed, args.arrival, args.cv)
        for policy in args.interception_policies:
            engine = make_engine(policy)
            res = replay(engine, reqs, arrivals, real_clock_wait, seed=args.seed, progress=not args.no_progress,
                         desc=f"{policy} @ {rate:g} req/s", deadline_s=args.deadline_s)
            rows.append({"policy": policy, "rate": rate, **res.to_dict()})
    device = getattr(executor, "device_name", "cpu")
    title = (f"segue bench intercept — {probe.model_name} on {device}, {base.cache.kv_cache_tokens} KV tokens, "
             f"{base.scheduler.max_num_batched_tokens} tokens/step, {base.scheduler.policy} ordering")
    print(render_markdown(rows, args.latency_slo, title))
    print(f"\n{dropped} trace requests dropped (context ≥ max_model_len {probe.max_model_len}); "
          f"{args.num_requests} requests per run")
    if args.output_json:
        result = {
            "command": shlex.join([os.path.basename(sys.argv[0]) or "segue", *sys.argv[1:]]),
            "model": probe.model_name, "device": device, "kv_cache_tokens": base.cache.kv_cache_tokens,
            "max_num_batched_tokens": base.scheduler.max_num_batched_tokens,
            "max_model_len": probe.max_model_len, "dropped_requests": dropped,
            "latency_slo": args.latency_slo, "rows": rows,
        }
        with open(args.output_json, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=2)
            f.write("\n")
    return 0


BENCHMARK = Benchmark(
    name="intercept",
    help="replay the InferCept trace open-loop on the real engine, per interception policy and rate",
    add_arguments=add_arguments,
    run=run,
)
