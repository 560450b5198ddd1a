"""The interface the engine loop drives; the real model and the simulator both implement it."""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

from segue.sched.output import SchedulerOutput


@dataclass
class SampledToken:
    token_id: int
    logprob: float | None = None
    top: list[tuple[int, float]] | None = None


class Executor(ABC):
    num_device_blocks: int
    num_host_blocks: int
    block_size: int

    @abstractmethod
    def execute(self, out: SchedulerOutput) -> dict[str, SampledToken]:
        """Perform the step's block copies and forward pass; return the token sampled for every
        scheduled sequence whose `sample` flag is set, keyed by request id."""
