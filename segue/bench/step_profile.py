"""`segue bench step-profile`: where the time of one decode step goes, by category.

Fills a batch (default 64 requests of 256 prompt tokens, the throughput workload), prefills it,
then profiles decode steps with torch.profiler and splits the wall time into: linear layers, the
LM head, attention, KV writes, sampling, other tensor ops, and Python/scheduler time (wall minus
the profiled op time)."""
from __future__ import annotations

import argparse
import random
import time
from collections import defaultdict

from segue.bench import Benchmark

# Profiler op name -> category. Matched on the outermost ops the model calls.
_CATEGORIES = {
    "aten::linear": "linear layers", "aten::addmm": "linear layers", "aten::mm": "linear layers",
    "segue_cpu_paged_attention.paged_decode_attention": "attention",
    "aten::scaled_dot_product_attention": "attention", "aten::index_select": "attention",
    "aten::index_copy_": "KV writes", "aten::argmax": "sampling", "aten::sort": "sampling",
    "aten::topk": "sampling", "aten::log_softmax": "sampling", "aten::multinomial": "sampling",
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)


def run(args: argparse.Namespace) -> int:
    import torch
    from torch.profiler import ProfilerActivity, profile

    from segue.cli import engine_config_from_args
    from segue.engine import LLMEngine
    from segue.sampling_params import SamplingParams

    engine = LLMEngine(engine_config_from_args(args))
    rng = random.Random(args.seed)
    vocab = engine.model_config.vocab_size
    for _ in range(args.num_requests):
        prompt = [rng.randrange(1000, vocab - 1000) for _ in range(args.prompt_len)]
        engine.add_request(None, prompt, SamplingParams(temperature=0, max_tokens=10_000, ignore_eos=True))
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.requests.values()):
        engine.step()
    for _ in range(2):
        engine.step()
    lm_head = engine.executor.model.lm_head
    totals: dict[str, float] = defaultdict(float)
    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(args.steps):
            engine.step()
    wall = (time.perf_counter() - t0) / args.steps * 1000
    for evt in prof.key_averages(group_by_input_shape=True):
        if evt.key not in _CATEGORIES and not evt.key.startswith("aten::"):
            continue
        cat = _CATEGORIES.get(evt.key, "other tensor ops")
        if cat == "linear layers" and evt.input_shapes and any(
                list(s) == list(lm_head.shape) for s in evt.input_shapes if s):
            cat = "LM head"
        totals[cat] += evt.self_cpu_time_total / 1000 / args.steps
    # Nested ops (linear -> mm) count once: only self time is summed above.
    profiled = sum(totals.values())
    totals["python, scheduler, detokenizer"] = max(0.0, wall - profiled)
    print(f"decode step at batch {args.num_requests}, context ~{args.prompt_len}: {wall:.1f} ms wall "
          f"(profiler on), {args.num_requests / wall * 1000:.0f} tok/s; torch threads {torch.get_num_threads()}")
    print("| category | ms/step | share |\n|---|---:|---:|")
    for cat, ms in sorted(totals.items(), key=lambda kv: -kv[1]):
        print(f"| {cat} | {ms:.1f} | {ms / wall:.0%} |")
    return 0


BENCHMARK = Benchmark(name="step-profile", help="where one decode step's time goes", add_arguments=add_arguments,
                      run=run, description=__doc__)
