"""The interface of interception policies: what happens to a paused request's KV each step."""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

from segue.request import Disposition, Request
from segue.sched.cost_model import CostModel


@dataclass
class PausedRequest:
    """What a policy sees of one intercepted request."""
    request: Request
    device_tokens: int     # context tokens whose KV is on the device
    host_tokens: int       # context tokens already swapped to the host
    elapsed_s: float       # time since the interception began
    expected_s: float | None  # expected total duration (trace, tool statistics), if known

    @property
    def context_tokens(self) -> int:
        return self.device_tokens + self.host_tokens


def estimated_duration(p: PausedRequest) -> float:
    """How much longer the pause is expected to last: the known duration minus the time already
    paused, or InferCept's dynamic estimate when none is known, t_now - t_call, which grows every
    step the request stays paused (long pauses tend to go on). A pause that outlasts its expected
    duration by x is expected to last x more, by the same reasoning: a held turn announced for a
    resume that does not come decays toward release instead of being held at zero cost forever."""
    if p.expected_s is not None:
        return abs(p.expected_s - p.elapsed_s)
    return p.elapsed_s


@dataclass
class StepState:
    now: float
    running_tokens: int       # context tokens of running requests (C_other)
    num_running: int          # sequences that decode this step (one query token each)
    swap_out_budget: int      # tokens that may be copied to the host this step
    cost: CostModel


@dataclass
class Decision:
    disposition: Disposition
    swap_out_tokens: int = 0  # how many device tokens to copy out this step (SWAP only)


class InterceptionPolicy(ABC):
    name: ClassVar[str]
    # `discard` (vLLM) sends a resumed request to the back of the queue; the others keep its
    # original arrival time.
    keeps_arrival_time: ClassVar[bool] = True
    # False for policies that never change a paused request's KV (skips building their views).
    acts_on_paused: ClassVar[bool] = True

    @abstractmethod
    def decide(self, paused: list[PausedRequest], state: StepState) -> dict[str, Decision]:
        """Called every step for all paused requests that still hold device KV; requests left out
        keep their device KV (PRESERVE)."""

