"""Part of `segue profile`: what decode attention pays when a sequence's blocks are scattered over
the pool (CostModel.fwd_ms_per_scattered_block and prefetch_warmup_blocks).

A fresh engine hands out blocks in one piece, so the profile's decode steps never see what a busy
pool does: blocks freed all over it, reused by whichever sequence asks next. Attention then reads
many short runs of consecutive blocks, and the CPU's prefetchers need a few blocks of each run to
catch up (on an AMD EPYC with avx512_bf16, 4 sequences x 2,000 tokens read runs of 8 blocks 2.1x
slower than one piece before the kernel prefetched in software). The same decode batch is timed
over three layouts of the same number of blocks, taking turns: in one piece, shuffled over the
pool (every block its own run: the cost of one block read cold), and in runs of `RUN` blocks (how
many blocks of a run are cold). The steps go straight to the executor with hand-made block tables;
their KV is whatever the pool holds, which attention's cost does not depend on.
"""
from __future__ import annotations

import random
import statistics
import time
from dataclasses import dataclass

from segue.arith import cdiv
from segue.engine.llm_engine import LLMEngine
from segue.request import Request
from segue.sampling_params import SamplingParams
from segue.sched.cost_model import scattered_blocks
from segue.sched.output import ScheduledSeq, SchedulerOutput

RUN = 8  # blocks per run in the third layout; the fitted warm-up is at most this


@dataclass(frozen=True)
class ScatterProfile:
    ms_per_scattered_block: float  # 0 where shuffling costs nothing measurable
    warmup_blocks: int             # 0 with it
    step_ms: dict[str, float]      # median step time per layout

    def describe(self) -> str:
        steps = ", ".join(f"{k} {v:.1f} ms" for k, v in self.step_ms.items())
        return (f"scattered blocks: {self.ms_per_scattered_block * 1000:.1f} us per cold block, "
                f"{self.warmup_blocks} cold blocks per run (decode steps: {steps})")


def decode_context(engine: LLMEngine, seqs: int, context: int) -> int:
    """`context`, cut so that `seqs` sequences of it fit the model and half the device pool."""
    return min(context, engine.max_model_len - 1, (engine.executor.num_device_blocks // 2)
               * engine.executor.block_size // seqs)


def one_piece(seqs: int, per_seq: int) -> list[list[int]]:
    """Block tables of `per_seq` blocks each, one after the other from block 0."""
    return [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(seqs)]


def decode_batch(tag: str, tables: list[list[int]], context: int) -> SchedulerOutput:
    """One decode step of a sequence per table, each at `context` tokens: for the executor only
    (its KV is whatever the pool holds, which the step's cost does not depend on)."""
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    return SchedulerOutput([ScheduledSeq(Request(f"{tag}-{i}", [7] * context, params, 0.0), [7], context - 1,
                                         table, True) for i, table in enumerate(tables)])


def _layouts(num_blocks: int, seqs: int, per_seq: int, rng: random.Random) -> dict[str, list[list[int]]]:
    shuffled_ids = rng.sample(range(num_blocks), seqs * per_seq)
    shuffled = [shuffled_ids[i * per_seq:(i + 1) * per_seq] for i in range(seqs)]
    starts = rng.sample(range(num_blocks // RUN), seqs * cdiv(per_seq, RUN))
    runs = [[b for start in starts[i * cdiv(per_seq, RUN):(i + 1) * cdiv(per_seq, RUN)]
             for b in range(start * RUN, start * RUN + RUN)][:per_seq] for i in range(seqs)]
    return {"one piece": one_piece(seqs, per_seq), "shuffled": shuffled, f"runs of {RUN}": runs}


def measure_scatter(engine: LLMEngine, seqs: int = 4, context: int = 2048, repeats: int = 9,
                    seed: int = 0) -> ScatterProfile | None:
    """Time one decode step of `seqs` sequences at `context` tokens over each layout; None where the
    engine has no KV pool of its own (the simulator) or too small a one."""
    executor = engine.executor
    if getattr(executor, "kv_cache", None) is None:
        return None
    num_blocks = executor.num_device_blocks
    context = decode_context(engine, seqs, context)
    per_seq = cdiv(context, executor.block_size)
    if per_seq < 2 * RUN or seqs * per_seq * 2 > num_blocks:
        return None
    layouts = _layouts(num_blocks, seqs, per_seq, random.Random(seed))

    def step(tables: list[list[int]]) -> float:
        out = decode_batch("scatter", tables, context)
        t0 = time.perf_counter()
        executor.execute(out)
        return (time.perf_counter() - t0) * 1000

    for tables in layouts.values():  # warm-up
        step(tables)
    times: dict[str, list[float]] = {name: [] for name in layouts}
    for _ in range(repeats):  # taking turns, so the machine's drift hits every layout alike
        for name, tables in layouts.items():
            times[name].append(step(tables))
    ms = {name: statistics.median(t) for name, t in times.items()}
    extra = {name: ms[name] - ms["one piece"] for name in layouts}
    if extra["shuffled"] <= 0:
        return ScatterProfile(0.0, 0, ms)

    def cold(name: str, warmup: int) -> int:
        return sum(scattered_blocks(t, warmup) for t in layouts[name])

    # The shuffled layout prices a cold block given the warm-up; the runs pick the warm-up. (A
    # warm-up that leaves no shuffled block cold cannot be priced: a sample that dense is not a
    # scattered table.)
    runs = f"runs of {RUN}"
    priced = [w for w in range(1, RUN + 1) if cold("shuffled", w) > 0]
    if not priced:
        return ScatterProfile(0.0, 0, ms)
    warmup = min(priced, key=lambda w: abs(extra["shuffled"] / cold("shuffled", w) * cold(runs, w) - extra[runs]))
    return ScatterProfile(extra["shuffled"] / cold("shuffled", warmup), warmup, ms)
