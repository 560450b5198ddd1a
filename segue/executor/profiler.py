"""`segue profile`: measure the costs the scheduler reasons with on this device (InferCept's
offline profiler): iteration time as a function of batched tokens, the saturation point, and
the host<->device swap bandwidth. The engine loads the result at start-up."""
from __future__ import annotations

import logging
import random
import time

import numpy as np

from segue.engine import LLMEngine
from segue.sampling_params import SamplingParams
from segue.sched.cost_model import CostModel

logger = logging.getLogger(__name__)

TOKEN_POINTS = (1, 16, 32, 64, 128, 256, 384, 512, 768, 1024)


def _time_prefill(engine: LLMEngine, tokens: int, repeats: int, rng: random.Random) -> float:
    """Median seconds of one step that prefills `tokens` fresh tokens."""
    vocab = engine.model_config.vocab_size
    times = []
    for _ in range(repeats):
        prompt = [rng.randrange(vocab // 10, vocab - 10) for _ in range(tokens)]
        engine.add_request(None, prompt, SamplingParams(max_tokens=1, temperature=0))
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
        while engine.has_unfinished_requests():
            engine.step()
    return float(np.median(times))


def _swap_bandwidth(engine: LLMEngine, blocks: int = 64, repeats: int = 3) -> float:
    cache = getattr(engine.executor, "kv_cache", None)
    if cache is None or cache.host_k.shape[2] == 0:
        return CostModel().swap_bytes_per_s
    n = min(blocks, cache.num_blocks, cache.host_k.shape[2])
    out_map = [(i, i) for i in range(n)]
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        cache.swap_out(out_map)
        cache.swap_in(out_map)
        if cache.k.is_cuda:
            import torch
            torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - t0) / 2)
    return n * engine.executor.block_size * engine.executor.kv_bytes_per_token / best


def profile(engine: LLMEngine, repeats: int = 3, seed: int = 0) -> tuple[CostModel, list[tuple[int, float]]]:
    rng = random.Random(seed)
    budget = engine.config.scheduler.max_num_batched_tokens
    points = [t for t in TOKEN_POINTS if t <= min(budget, engine.max_model_len - 1)]
    _time_prefill(engine, points[0], 1, rng)  # warm-up (kernel build, allocator)
    measured = [(t, _time_prefill(engine, t, repeats, rng)) for t in points]
    for t, s in measured:
        logger.info("T_fwd(%d tokens) = %.1f ms", t, s * 1000)
    xs = np.array([t for t, _ in measured], dtype=float)
    ys = np.array([s for _, s in measured]) * 1000
    slope, intercept = np.polyfit(xs, ys, 1)
    # Saturation: the smallest batch that reaches 90% of the best tokens/s seen.
    rates = xs / ys
    saturation = int(xs[np.argmax(rates >= 0.9 * rates.max())])
    cost = CostModel(fwd_ms_per_token=float(max(slope, 1e-6)), fwd_base_ms=float(max(intercept, 0.0)),
                     saturation_tokens=saturation, swap_bytes_per_s=_swap_bandwidth(engine),
                     kv_bytes_per_token=engine.executor.kv_bytes_per_token,
                     device=engine.executor.device_name, source="profiled " + time.strftime("%Y-%m-%d"))
    return cost, measured
