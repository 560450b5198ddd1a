"""`segue profile`: measure the costs the scheduler and the simulator reason with on this device
(InferCept's offline profiler): step time as a function of batched tokens and attended context,
the saturation point, and the host<->device swap bandwidth. The engine loads the result at start-up.

Steps are measured through the real engine (scheduler, paged KV executor, sampling, outputs), as
whole `engine.step()` calls, because that is what a step costs a served request and what the
simulator charges per step. Four kinds are measured: prefills of several sizes, decode batches of
B sequences at context C, mixed steps (a prompt joining a running decode batch), and chunks
prefilled over a long cached prefix (an agent's next turn, a recomputed history). The model
step_ms = f(tokens) + c·context + e·attended pairs, f piecewise linear over the measured token
counts, is fitted to all of them jointly (segue/executor/step_fit); the straight line a·tokens + b
is fitted beside it for the scheduler's marginal cost of a token.
"""
from __future__ import annotations

import itertools
import json
import logging
import random
import statistics
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from segue.arith import cdiv
from segue.engine.engine_request import EngineRequest
from segue.engine.llm_engine import LLMEngine
from segue.executor.step_fit import StepFit, StepPoint, fit_steps
from segue.profiler.overlap import OverlapProfile, measure_swap_overlap
from segue.profiler.scatter import ScatterProfile, measure_scatter
from segue.sampling_params import SamplingParams
from segue.sched.cost_model import CostModel
from segue.sched.output import SchedulerOutput

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ProfileGrid:
    prefill_tokens: tuple[int, ...]                  # single prompts, each prefilled in one step
    decode_groups: tuple[tuple[int, int], ...]       # (sequences B, prompt context C) decode batches
    decode_steps: int = 4                            # decode steps timed per group (median)
    mixed_prompt: int = 128                          # prompt that joins each running batch once; 0: none
    repeats: int = 3                                 # per prefill size (median)
    # (cached prefix P, chunk N): an N-token prompt extension prefilled over a P-token prefix, to
    # measure prefill attention's growth with context (points beyond the prefill sizes' contexts).
    context_prefills: tuple[tuple[int, int], ...] = ()


# CPU: the grid keeps the prefill it needs to set up decode batches to ~30k tokens and `segue
# profile` to about half a minute; the batch prefills double as large prefill points. Decode
# batches reach 8k tokens of context (a pool's worth: with 2.2k at most, the per-context-token
# cost was extrapolated 4x and came out 0.0013-0.0021 ms from one profile to the next); the
# context prefills reach the 4k contexts agents' histories have (their prefixes' own prefill
# steps are points too).
CPU_GRID = ProfileGrid(prefill_tokens=(16, 64, 256),
                       decode_groups=((1, 128), (2, 128), (4, 128), (8, 128), (16, 128), (32, 64),
                                      (1, 512), (4, 512), (1, 1024), (4, 2048), (8, 1024), (2, 3584)),
                       decode_steps=8, context_prefills=((1024, 512), (3072, 512), (3584, 256)))
# CUDA: prefill is cheap, so the full B x C grid and more repeats.
CUDA_GRID = ProfileGrid(prefill_tokens=(16, 64, 256, 1024, 2048),
                        decode_groups=tuple(itertools.product((1, 4, 16, 32, 64), (128, 512, 1024))),
                        decode_steps=8, repeats=5,
                        context_prefills=((2048, 1024), (6144, 1024), (14336, 2048)))
# Tests: a tiny model, a few seconds.
TINY_GRID = ProfileGrid(prefill_tokens=(8, 32), decode_groups=((1, 32), (4, 32), (2, 96)), decode_steps=3,
                        mixed_prompt=16, repeats=2, context_prefills=((96, 16),))


def _on_cuda(engine: LLMEngine) -> bool:
    return getattr(getattr(engine.executor, "device", None), "type", "cpu") == "cuda"


def default_grid(engine: LLMEngine) -> ProfileGrid:
    return CUDA_GRID if _on_cuda(engine) else CPU_GRID


@dataclass
class ProfileReport:
    points: list[StepPoint]
    fit: StepFit          # the curve the CostModel charges
    line_fit: StepFit     # a·tokens + b + c·context: its slope is the CostModel's marginal token cost
    per_seq_fit: StepFit  # the line with a per-sequence term: how much a form without one misses
    seconds: float                                   # wall time of the measurements
    skipped: list[str] = field(default_factory=list)  # grid entries this engine cannot run, and why
    timer: str = "wall"                               # which step time the fit is of: wall or cpu
    scatter: ScatterProfile | None = None             # decode over scattered blocks (scatter.py)
    overlap: OverlapProfile | None = None             # a decode beside a copy (overlap.py)

    def to_dict(self) -> dict[str, Any]:
        # Wall over CPU time of one-thread steps: ~1 on an idle machine, more when others load it
        # (the fit is of wall time, so it carries that load in).
        timed = [p.step_ms / p.cpu_ms for p in self.points if p.cpu_ms > 0]
        load = statistics.median(timed) if timed else None
        return {"fit": self.fit.to_dict(), "line_fit": self.line_fit.to_dict(),
                "per_seq_fit": self.per_seq_fit.to_dict(),
                "points": [asdict(p) for p in self.points], "wall_over_cpu_median": load,
                "timer": self.timer, "profile_seconds": self.seconds, "skipped": self.skipped,
                "scatter_step_ms": self.scatter.step_ms if self.scatter else None,
                "overlap": asdict(self.overlap) if self.overlap else None}


@dataclass(frozen=True)
class _Step:
    kind: str
    tokens: int
    context: int
    seqs: int
    ms: float
    cpu_ms: float
    pairs: int


@contextmanager
def _recording(engine: LLMEngine) -> Iterator[list[SchedulerOutput]]:
    """Collect the batch of every executed step. The wrapper is an instance attribute that is
    removed again afterwards, so an executor shared with later engines runs unwrapped."""
    executor = engine.executor
    had_own = "execute" in vars(executor)
    inner = executor.execute
    batches: list[SchedulerOutput] = []

    def execute(out: SchedulerOutput) -> Any:
        batches.append(out)
        return inner(out)

    executor.execute = execute  # type: ignore[method-assign]  # an instance attribute, removed below
    try:
        yield batches
    finally:
        if had_own:
            executor.execute = inner  # type: ignore[method-assign]
        else:
            del executor.execute


def _shape(out: SchedulerOutput, ms: float, cpu_ms: float) -> _Step:
    singles = sum(1 for s in out.seqs if s.num_tokens == 1)
    kind = "decode" if singles == len(out.seqs) else "prefill" if singles == 0 else "mixed"
    return _Step(kind, out.num_batched_tokens, out.num_context_tokens, len(out.seqs), ms, cpu_ms,
                 out.num_attended_pairs)


class _Runner:
    def __init__(self, engine: LLMEngine, rng: random.Random) -> None:
        self.engine = engine
        self.rng = rng
        self.vocab = engine.model_config.vocab_size

    def add(self, tokens: int, max_tokens: int, prefix: list[int] | None = None) -> list[int]:
        # Random ids (no prefix-cache hits beyond `prefix`), away from the special tokens at both ends.
        prompt = (prefix or []) + [self.rng.randrange(self.vocab // 10, self.vocab - 10) for _ in range(tokens)]
        params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        self.engine.add_request(EngineRequest(prompt, params))
        return prompt

    def run(self, join_after_decodes: int = -1, join_tokens: int = 0) -> list[_Step]:
        """Step until every request finishes, timing each step; after `join_after_decodes` decode
        steps a `join_tokens` prompt joins (one step: it finishes at its first token)."""
        steps: list[_Step] = []
        decodes = 0
        with _recording(self.engine) as batches:
            while self.engine.has_unfinished_requests():
                if decodes == join_after_decodes and join_tokens:
                    self.add(join_tokens, 1)
                    join_after_decodes = -1
                batches.clear()
                t0, c0 = time.perf_counter(), time.process_time()
                self.engine.step()
                ms, cpu_ms = (time.perf_counter() - t0) * 1000, (time.process_time() - c0) * 1000
                if batches:
                    steps.append(_shape(batches[-1], ms, cpu_ms))
                    decodes += steps[-1].kind == "decode"
        return steps


def _point(steps: list[_Step]) -> StepPoint:
    """Median time of steps of one shape (decode steps: context grows by B per step; its mean)."""
    return StepPoint(kind=steps[0].kind, batched_tokens=round(statistics.mean(s.tokens for s in steps)),
                     context_tokens=round(statistics.mean(s.context for s in steps)),
                     num_seqs=steps[0].seqs, step_ms=statistics.median(s.ms for s in steps), repeats=len(steps),
                     cpu_ms=statistics.median(s.cpu_ms for s in steps),
                     attended_pairs=round(statistics.mean(s.pairs for s in steps)))


def measure_steps(engine: LLMEngine, grid: ProfileGrid, seed: int = 0) -> tuple[list[StepPoint], list[str]]:
    """Time the grid's steps on `engine`, which must be idle; returns the points and what was skipped."""
    if engine.has_unfinished_requests():
        raise RuntimeError("profile an idle engine: it has unfinished requests")
    runner = _Runner(engine, random.Random(seed))
    sched = engine.config.scheduler
    budget, bs = sched.max_num_batched_tokens, engine.executor.block_size
    pool = engine.executor.num_device_blocks * bs
    limit = engine.max_model_len
    points: list[StepPoint] = []
    skipped: list[str] = []
    # Warm-up: first-use costs (allocator, kernels, caches) belong to no step kind.
    runner.add(min(32, limit - 4), 3)
    runner.run()
    for tokens in grid.prefill_tokens:
        if tokens > min(budget, limit - 1):
            skipped.append(f"prefill {tokens}: over the step budget or context limit")
            continue
        steps = []
        for _ in range(grid.repeats):
            runner.add(tokens, 1)
            steps += runner.run()
        points.append(_point([s for s in steps if s.kind == "prefill"]))
    for b, c in grid.decode_groups:
        # The first token comes from the prefill step, and the step the prompt joins is mixed.
        max_tokens = grid.decode_steps + 1 + bool(grid.mixed_prompt)
        blocks = b * cdiv(c + max_tokens, bs) + cdiv(grid.mixed_prompt + 1, bs)
        if b > sched.max_num_seqs or c + max_tokens > limit or blocks * bs > pool:
            skipped.append(f"decode B={b} C={c}: over max_num_seqs, the context limit or the KV pool")
            continue
        for _ in range(b):
            runner.add(c, max_tokens)
        join = grid.mixed_prompt if grid.mixed_prompt and grid.mixed_prompt + b <= budget else 0
        steps = runner.run(join_after_decodes=grid.decode_steps // 2, join_tokens=join)
        # The batch's decode steps are one shape (context grows by B a step); prefill chunks and
        # mixed steps (the joining prompt, or chunked prompts beside early decodes) each their own.
        points += [_point([s]) for s in steps if s.kind != "decode"]
        decodes = [s for s in steps if s.kind == "decode" and s.seqs == b]
        if decodes:
            points.append(_point(decodes))
    for prefix, chunk in grid.context_prefills:
        if prefix + chunk + 1 > limit or cdiv(prefix + chunk + 1, bs) * bs > pool:
            skipped.append(f"context prefill {chunk} over {prefix}: over the context limit or the KV pool")
            continue
        # The prefix's own prefill steps are points too; the extension then runs over its cached
        # blocks (over all of it again where prefix caching is off: still a measured shape).
        cached = runner.add(prefix, 1)
        points += [_point([s]) for s in runner.run()]
        runner.add(chunk, 1, prefix=cached)
        points += [_point([s]) for s in runner.run()]
    return points, skipped


def _saturation(points: list[StepPoint]) -> int:
    """The smallest prefill that reaches 90% of the best tokens/s seen: beyond it a step gets
    slower without getting more useful work done."""
    prefills = sorted((p.batched_tokens, p.batched_tokens / p.step_ms) for p in points if p.kind == "prefill")
    if not prefills:
        return CostModel().saturation_tokens
    best = max(rate for _, rate in prefills)
    return next(tokens for tokens, rate in prefills if rate >= 0.9 * best)


def _swap_bandwidth(engine: LLMEngine, blocks: int = 256, repeats: int = 3, seed: int = 0) -> float:
    """Bytes per second of a swap-out and swap-in of `blocks` blocks scattered over both pools, as
    a server's are (consecutive ids copy as one run, and a small hot set from the caches: the
    first version, 64 blocks 0..63 both ways, read 8 GB/s where scattered copies ran at 1.4)."""
    cache = getattr(engine.executor, "kv_cache", None)
    if cache is None or cache.host_k.shape[2] == 0:
        return CostModel().swap_bytes_per_s
    n = min(blocks, cache.num_blocks, cache.host_k.shape[2])
    rng = random.Random(seed)
    out_map = list(zip(rng.sample(range(cache.num_blocks), n), rng.sample(range(cache.host_k.shape[2]), n),
                       strict=True))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        cache.swap_out(out_map)
        cache.swap_in([(h, d) for d, h in out_map])
        if cache.k.is_cuda:
            import torch
            torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) / 2)
    return n * engine.executor.block_size * engine.executor.kv_bytes_per_token / statistics.median(times)


def profile(engine: LLMEngine, repeats: int | None = None, seed: int = 0, grid: ProfileGrid | None = None,
            timer: str = "wall") -> tuple[CostModel, ProfileReport]:
    """Measure and fit. `repeats` overrides the grid's repeats of each prefill size. timer "wall"
    fits wall-clock step time (what a request waits; right on a dedicated machine); "cpu" fits the
    process's CPU time, the step's own cost without other processes' load, which equals wall time
    only for a one-thread CPU engine (--threads 1) and is for profiling on a shared machine."""
    if timer not in ("wall", "cpu"):
        raise ValueError(f"timer must be 'wall' or 'cpu', got {timer!r}")
    grid = grid or default_grid(engine)
    if repeats is not None:
        grid = replace(grid, repeats=repeats)
    t0 = time.perf_counter()
    points, skipped = measure_steps(engine, grid, seed)
    timed = points if timer == "wall" else [replace(p, step_ms=p.cpu_ms) for p in points]
    fit, line = fit_steps(timed, curve=True), fit_steps(timed)
    scatter = measure_scatter(engine, seed=seed)
    overlap = measure_swap_overlap(engine, seed=seed)
    report = ProfileReport(points, fit, line, fit_steps(timed, per_seq=True), time.perf_counter() - t0, skipped, timer,
                           scatter, overlap)
    for p in timed:
        logger.info("%s step: %d tokens, %d context, %d pairs, %d seqs: %.1f ms (fit %.1f)", p.kind,
                    p.batched_tokens, p.context_tokens, p.attended_pairs, p.num_seqs, p.step_ms,
                    fit.predict_ms(p.batched_tokens, p.context_tokens, pairs=p.attended_pairs))
    cost = CostModel(fwd_ms_per_token=max(line.ms_per_token, 1e-6), fwd_base_ms=line.base_ms, fwd_curve_ms=fit.curve,
                     fwd_ms_per_context_token=fit.ms_per_context_token,
                     fwd_ms_per_attended_pair=fit.ms_per_attended_pair, saturation_tokens=_saturation(timed),
                     fwd_ms_per_scattered_block=scatter.ms_per_scattered_block if scatter else 0.0,
                     prefetch_warmup_blocks=scatter.warmup_blocks if scatter else 0,
                     swap_bytes_per_s=_swap_bandwidth(engine), kv_bytes_per_token=engine.executor.kv_bytes_per_token,
                     swaps_overlap_compute=_on_cuda(engine),
                     swap_compute_slowdown=overlap.slowdown if overlap else 1.0,
                     swap_bytes_per_s_beside_compute=overlap.copy_bytes_per_s_beside if overlap else 0.0,
                     device=engine.executor.device_name, source=f"profiled {time.strftime('%Y-%m-%d')} ({timer} time)")
    return cost, report


def save_profile(path: str | Path, cost: CostModel, report: ProfileReport, key: dict[str, str] | None = None) -> None:
    """The CostModel's fields (what CostModel.load reads) plus the fit's quality and the measured
    points, so a profile can be judged and refitted later without rerunning it, and what it was
    measured under (`key`: executor/loading.py's profile_key, which names its default path)."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    extra = {"key": key} if key is not None else {}
    Path(path).write_text(json.dumps({**asdict(cost), **report.to_dict(), **extra}, indent=2) + "\n")
