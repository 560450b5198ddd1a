"""`segue bench step-profile`: where the time of one decode step goes, by category.

Fills a batch (default 64 requests of 256 prompt tokens, the throughput workload), prefills it,
then profiles decode steps with cProfile and splits the wall time into: linear layers, the LM head,
attention, other tensor ops, batch building, sampling, the scheduler, detokenization, and the
remaining Python. Before profiling, the same steps run unprofiled: their time against the weight bytes
a decode step reads gives the achieved weight traffic in GB/s, beside this machine's measured read
bandwidth (segue/profiler/bandwidth.py): for one sequence, how close decode runs to its limit."""
from __future__ import annotations

import argparse
import random
import time
from typing import cast

from segue.bench import Benchmark


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--num-requests", type=int, default=64, help="requests decoding together: the batch (default: 64)")
    p.add_argument("--prompt-len", type=int, default=256, help="prompt tokens per request: the context (default: 256)")
    p.add_argument("--steps", type=int, default=8, help="decode steps profiled (default: 8)")
    p.add_argument("--seed", type=int, default=0, help="seeds the prompts (default: 0)")
    p.add_argument("--temperature", type=float, default=None,
                   help="sampling temperature (default: what a client that sends none gets, the "
                        "model's recommended settings; 0 = greedy)")
    p.add_argument("--top-p", type=float, default=None, help="nucleus (default: as --temperature)")


def run(args: argparse.Namespace) -> int:
    import torch

    from segue.engine.args import engine_config_from_args
    from segue.engine.engine_request import EngineRequest
    from segue.engine.llm_engine import LLMEngine
    from segue.executor.model_executor import ModelExecutor
    from segue.sampling_params import SamplingParams

    engine = LLMEngine(engine_config_from_args(args))
    # Profile the sampling a server client gets: with no settings sent, the model's recommended ones.
    sampling = dict(engine.generation_defaults)
    sampling.update({k: v for k, v in (("temperature", args.temperature), ("top_p", args.top_p)) if v is not None})
    rng = random.Random(args.seed)
    vocab = engine.model_config.vocab_size
    for _ in range(args.num_requests):
        prompt = [rng.randrange(1000, vocab - 1000) for _ in range(args.prompt_len)]
        engine.add_request(EngineRequest(prompt, SamplingParams(max_tokens=2 * args.steps + 8, ignore_eos=True,
                                                                **sampling)))
    needed = args.num_requests * (args.prompt_len + 2 * args.steps + 8)
    pool = engine.scheduler.state.kv_counters().num_blocks * engine.scheduler.state.kv.block_size
    if needed > pool:
        raise SystemExit(f"the batch needs {needed} KV tokens but the pool holds {pool}: "
                         f"pass --kv-cache-tokens {needed}")
    while any(r.num_output_tokens == 0 for r in engine.scheduler.state.requests.values()):
        engine.step()
    for _ in range(2):
        engine.step()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        engine.step()
    unprofiled = (time.perf_counter() - t0) / args.steps
    import cProfile
    import pstats

    profiler = cProfile.Profile()
    t0 = time.perf_counter()
    profiler.enable()
    for _ in range(args.steps):
        engine.step()
    profiler.disable()
    wall = (time.perf_counter() - t0) / args.steps * 1000
    # An undocumented attribute (typeshed omits it), stable since Python 2: the raw table.
    stats = pstats.Stats(profiler).stats  # type: ignore[attr-defined]  # (file, line, name) -> (cc, nc, tottime, cumtime, callers)

    def ms(match, cumulative=False) -> float:
        total = sum(v[3] if cumulative else v[2] for k, v in stats.items() if match(k))
        return total * 1000 / args.steps

    # Every matmul with weights goes through LinearWeights.__call__ (fp32 GEMM or quantized kernel).
    linear = ms(lambda k: k[2] == "__call__" and k[0].endswith(("quant.py", "gguf_blocks.py")), cumulative=True)
    lm_head = ms(lambda k: k[2] == "compute_logits", cumulative=True)
    attention = ms(lambda k: "paged_decode_attention" in k[2] or "scaled_dot_product_attention" in k[2]
                   or "index_select" in k[2])
    forward = ms(lambda k: k[2] == "forward" and k[0].endswith("llama.py"), cumulative=True)
    rows = {
        "linear layers (QKV, O, MLP)": linear - lm_head,
        "LM head + logits": lm_head,
        "attention": attention,
        "other tensor ops in the forward (norms, RoPE, SiLU, KV writes)": forward - (linear - lm_head) - attention,
        "batch metadata (executor)": ms(lambda k: k[2] == "_build_metadata", cumulative=True),
        "sampling": ms(lambda k: k[2] == "sample" and k[0].endswith("sampler.py"), cumulative=True),
        "scheduler": ms(lambda k: k[2] in ("schedule", "update_from_output") and "scheduler" in k[0], cumulative=True),
        "detokenizer + outputs": ms(lambda k: k[2] in ("append", "make_output") and
                                    ("detokenizer" in k[0] or "request_text" in k[0]), cumulative=True),
    }
    rows["other Python"] = max(0.0, wall - sum(rows.values()))
    ex = cast(ModelExecutor, engine.executor)  # LLMEngine(config) builds the model's executor
    print(f"decode step at batch {args.num_requests}, context ~{args.prompt_len}: {wall:.1f} ms wall "
          f"(cProfile on), {args.num_requests / wall * 1000:.0f} tok/s; torch threads {torch.get_num_threads()}; "
          f"{str(ex.dtype).removeprefix('torch.')}, KV cache {str(ex.kv_dtype).removeprefix('torch.')}, "
          f"quantization {ex.quantization.value}, "
          f"fused CPU ops {'on' if ex.model.kernels is not None else 'off'}; sampling {sampling or 'OpenAI defaults'}")
    from segue.profiler.bandwidth import read_bandwidth_gbs

    streamed = ex.model.streamed_bytes()
    achieved, limit = streamed / unprofiled / 1e9, read_bandwidth_gbs()
    print(f"unprofiled: {unprofiled * 1000:.1f} ms/step; weights read per step {streamed / 2**20:.0f} MiB -> "
          f"{achieved:.1f} GB/s of weight traffic, {achieved / limit:.0%} of this machine's measured read "
          f"bandwidth ({limit:.1f} GB/s, {torch.get_num_threads()} threads)")
    print("| part | ms/step | share |\n|---|---:|---:|")
    for name, value in rows.items():
        print(f"| {name} | {value:.1f} | {value / wall:.0%} |")
    return 0


BENCHMARK = Benchmark(name="step-profile", help="where one decode step's time goes", add_arguments=add_arguments,
                      run=run, description=__doc__)
