"""The interface the engine loop drives; the real model and the simulator both implement it."""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

from segue.sched.output import SchedulerOutput


@dataclass
class SampledToken:
    token_id: int
    logprob: float | None = None
    top: list[tuple[int, float]] | None = None
    # The final-norm hidden state the token was sampled from (a float32 numpy vector), only for
    # requests named in Executor.want_hidden_states before this step.
    hidden: Any = None


class Executor(ABC):
    num_device_blocks: int
    num_host_blocks: int
    block_size: int
    # What a cost model records about the executor (the profiler, the simulator's calibration).
    kv_bytes_per_token: int
    device_name: str

    @abstractmethod
    def execute(self, out: SchedulerOutput) -> dict[str, SampledToken]:
        """Perform the step's block copies and forward pass; return the token sampled for every
        scheduled sequence whose `sample` flag is set, keyed by request id."""

    def want_hidden_states(self, request_ids: Collection[str]) -> bool:
        """Ask the next execute() to attach SampledToken.hidden for these requests (the online
        output-length predictor's TRAIL feature); the ask covers that one step. Returns False
        where the executor has no hidden states (the simulator)."""
        return False
