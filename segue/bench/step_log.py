"""Per-step timings of a real engine, for checking a cost model against what steps really cost.

`StepLog.attach(engine)` wraps the engine's `step` and its executor's `execute` (instance attributes,
the classes are untouched) and records, per executed step, the batch's shape, the forward time and
the whole step's time (scheduling, sampling bookkeeping, detokenization and outputs included).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass(frozen=True)
class StepSample:
    batched_tokens: int
    context_tokens: int  # KV positions attended over, summed over the batch
    num_seqs: int
    prefill: bool  # some sequence fed more than one token
    execute_s: float
    step_s: float
    attended_pairs: int = 0  # (query, key) pairs, summed over the batch (cost_model.attended_pairs)
    scattered_blocks: int = 0  # blocks its decodes read cold (SchedulerOutput.num_scattered_blocks)


@dataclass
class StepLog:
    samples: list[StepSample] = field(default_factory=list)

    def attach(self, engine: Any, warmup_blocks: int = 0) -> None:
        """`warmup_blocks`: the cost model's prefetch_warmup_blocks, to count scattered blocks by."""
        executor, step = engine.executor, engine.step
        execute = executor.execute
        pending: list[tuple[int, int, int, bool, float, int, int]] = []

        def timed_execute(out: Any) -> Any:
            t0 = time.perf_counter()
            result = execute(out)
            pending.append((out.num_batched_tokens, out.num_context_tokens, len(out.seqs),
                            any(s.num_tokens > 1 for s in out.seqs), time.perf_counter() - t0,
                            out.num_attended_pairs, out.num_scattered_blocks(executor.block_size, warmup_blocks)))
            return result

        def timed_step() -> Any:
            pending.clear()
            t0 = time.perf_counter()
            outputs = step()
            if pending:
                tokens, context, seqs, prefill, execute_s, pairs, scattered = pending[-1]
                self.samples.append(StepSample(tokens, context, seqs, prefill, execute_s,
                                               step_s=time.perf_counter() - t0, attended_pairs=pairs,
                                               scattered_blocks=scattered))
            return outputs

        executor.execute = timed_execute
        engine.step = timed_step

    def arrays(self, prefill: bool | None = None) -> dict[str, np.ndarray]:
        kept = [s for s in self.samples if prefill is None or s.prefill == prefill]
        return {name: np.array([getattr(s, name) for s in kept], dtype=float)
                for name in ("batched_tokens", "context_tokens", "attended_pairs", "scattered_blocks", "num_seqs",
                             "execute_s", "step_s")}

    def fit(self) -> tuple[float, float, float]:
        """Least squares step_s ≈ a·batched + b + c·context, in (ms/token, ms, ms/context token),
        non-negative by clipping: what a cost model would need to predict these steps."""
        a = self.arrays()
        if len(a["step_s"]) < 3:
            raise ValueError("too few steps to fit")
        x = np.column_stack([a["batched_tokens"], np.ones_like(a["step_s"]), a["context_tokens"]])
        coef, *_ = np.linalg.lstsq(x, a["step_s"] * 1000, rcond=None)
        per_token, base, per_ctx = (max(0.0, float(c)) for c in coef)
        return per_token, base, per_ctx
