"""Part of `segue profile`: what a swap running beside the forward pass costs the forward
(CostModel.swap_compute_slowdown and swap_bytes_per_s_beside_compute).

A GPU copies with its copy engine while its SMs compute, so InferCept hides swaps behind the
forward pass. A CPU has no copy engine: a copy beside the forward takes cores from it, and the
forward's threads wait for the missing core at every barrier (2-core AMD EPYC, avx512_bf16: a
decode step of 4 x 2,048 tokens ran 1.6-1.8x slower while a thread copied blocks). That is why
KVTensors.start_swaps copies before the forward on a CPU; the measurement lets the simulator charge
an executor that overlaps them anyway, and shows on every new machine what overlapping would cost.

One decode batch (tables in one piece) is timed alone and while a thread swaps scattered blocks
out and back in without pause, taking turns; the copy's rate is what it moved while the steps
ran. Only CPU engines are measured: a GPU's side stream is taken not to slow the forward
(CostModel's defaults).
"""
from __future__ import annotations

import random
import statistics
import threading
import time
from dataclasses import dataclass

from segue.arith import cdiv
from segue.engine.llm_engine import LLMEngine
from segue.profiler.scatter import decode_batch, decode_context, one_piece


@dataclass(frozen=True)
class OverlapProfile:
    step_ms_alone: float
    step_ms_beside_copy: float
    copy_bytes_per_s_beside: float  # what the copying thread moved while the forward ran

    @property
    def slowdown(self) -> float:
        return max(1.0, self.step_ms_beside_copy / self.step_ms_alone)

    def describe(self) -> str:
        return (f"a copy beside the forward: decode step {self.step_ms_alone:.1f} ms alone, "
                f"{self.step_ms_beside_copy:.1f} ms beside it ({self.slowdown:.2f}x); the copy ran at "
                f"{self.copy_bytes_per_s_beside / 1e9:.1f} GB/s")


class _Copier:
    """Swaps `mapping` out and back in, over and over, on its own thread until stopped."""

    def __init__(self, cache, mapping: list[tuple[int, int]]) -> None:
        self.cache, self.mapping = cache, mapping
        self.rounds = 0
        self.started = threading.Event()
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._run, name="segue-profile-copy", daemon=True)

    def _run(self) -> None:
        back = [(h, d) for d, h in self.mapping]
        self.started.set()
        while not self.stopping.is_set():
            self.cache.swap_out(self.mapping)
            self.cache.swap_in(back)
            self.rounds += 1

    def __enter__(self) -> "_Copier":
        self.thread.start()
        self.started.wait()
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *_: object) -> None:
        self.stopping.set()
        self.thread.join()


def measure_swap_overlap(engine: LLMEngine, seqs: int = 4, context: int = 2048, copy_blocks: int = 16,
                         steps: int = 8, repeats: int = 5, seed: int = 0) -> OverlapProfile | None:
    """Time `steps` decode steps of `seqs` x `context` tokens alone and beside a thread copying
    `copy_blocks` blocks each way per round. None where the engine has no KV pool of its own (the
    simulator), no host tier, or a GPU."""
    executor = engine.executor
    cache = getattr(executor, "kv_cache", None)
    if cache is None or cache.k.is_cuda or cache.host_k.shape[2] == 0:
        return None
    bs, num_blocks = executor.block_size, executor.num_device_blocks
    context = decode_context(engine, seqs, context)
    per_seq = cdiv(context, bs)
    # The copy takes blocks the decode does not read, so both run as they would in a server.
    free = range(seqs * per_seq, num_blocks)
    n = min(copy_blocks, len(free), cache.host_k.shape[2])
    if context < bs or n == 0:
        return None
    rng = random.Random(seed)
    mapping = list(zip(rng.sample(free, n), rng.sample(range(cache.host_k.shape[2]), n), strict=True))
    round_bytes = 2 * n * bs * executor.kv_bytes_per_token
    out = decode_batch("overlap", one_piece(seqs, per_seq), context)

    def run_steps() -> float:
        t0 = time.perf_counter()
        for _ in range(steps):
            executor.execute(out)
        return (time.perf_counter() - t0) * 1000 / steps

    run_steps()  # warm-up
    cache.swap_out(mapping)  # the host blocks' first touch
    alone, beside, rate = [], [], []
    for _ in range(repeats):  # taking turns, so the machine's drift hits both alike
        alone.append(run_steps())
        with _Copier(cache, mapping) as copier:
            beside.append(run_steps())
            # Rounds done while the steps ran, the one under way counted half.
            rate.append((copier.rounds + 0.5) * round_bytes / (time.perf_counter() - copier.t0))
    return OverlapProfile(statistics.median(alone), statistics.median(beside), statistics.median(rate))
