"""The one interface every ordering policy implements."""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, ClassVar

from segue.request import Request
from segue.sched.cost_model import CostModel


@dataclass
class PolicyContext:
    """What a policy may consult besides the requests themselves: the profiled step cost, the
    KV pool's size, the learned tool durations, and per-policy options from the config."""
    cost: CostModel = field(default_factory=CostModel)
    kv_capacity_tokens: int = 16384
    block_size: int = 16
    # Any object with `quantile(tool, q) -> float | None` (segue.tools.stats.DurationStats).
    tool_stats: Any = None
    options: dict[str, Any] = field(default_factory=dict)


class SchedulingPolicy(ABC):
    """Orders requests: the scheduler serves running and waiting requests in ascending key
    order and preempts the running request with the largest key when memory runs out.

    The hooks let stateful policies track service and predictions; `now` is the scheduler's
    clock (virtual in the simulator)."""

    name: ClassVar[str]
    # Iteration-level preemption (FastServe): every step, running requests compete with waiting
    # ones for the token budget and the sequence slots in key order; one that loses keeps its KV
    # and waits, and under memory pressure lower-priority holders give up their KV in
    # `preemption_order`. False: running requests keep their place until memory runs out (vLLM).
    preemptive: ClassVar[bool] = False
    # Preemptive policies: the largest share of a step's token budget kept for the decodes of
    # requests that hold their KV (one token each, no new memory) when a higher-priority prefill
    # chunk would take the whole step. 0: strict priority order for every token.
    decode_share: float = 0.5

    def __init__(self, context: PolicyContext | None = None) -> None:
        self.context = context or PolicyContext()

    @abstractmethod
    def key(self, request: Request, now: float) -> Any:
        ...

    def order(self, requests: Iterable[Request], now: float) -> Iterable[Request]:
        """`requests` in ascending key order: who is served first. The scheduler asks every step,
        for a waiting queue of thousands under overload, and usually reads only the first few,
        so a policy that keeps its own order may return a lazy iterator."""
        return sorted(requests, key=lambda r: self.key(r, now))

    def on_arrival(self, request: Request, now: float) -> None:
        """Called once when a request enters the scheduler."""

    def on_step(self, now: float) -> None:
        """Called at the start of every scheduling step, before any key is computed."""

    def on_scheduled(self, request: Request, num_tokens: int, now: float) -> None:
        """Called for each request that ran this step (stateful policies track service)."""

    def on_intercepted(self, request: Request, now: float) -> None:
        """Called when a running request pauses for a tool or a human turn."""

    def on_resumed(self, request: Request, now: float) -> None:
        """Called when a paused request gets its appended tokens and may run again."""

    def on_finished(self, request: Request, now: float) -> None:
        """Called once when a request leaves the system."""

    def preemption_order(self, requests: list[Request], now: float) -> list[Request]:
        """Which KV holders give up memory first (first = first victim), for preemptive policies
        and for the arrival reserve. Default: the largest key first."""
        return sorted(requests, key=lambda r: self.key(r, now), reverse=True)

    def reserved_blocks(self, now: float) -> int:
        """Device blocks to keep free for arrivals; the scheduler swaps pending requests out (in
        `preemption_order`, within the step's swap budget) to keep them free. Default: none."""
        return 0
