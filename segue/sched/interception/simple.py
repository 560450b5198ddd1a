"""The fixed-disposition baselines: discard (vLLM), improved-discard, preserve, swap."""
from __future__ import annotations

from segue.request import Disposition
from segue.sched.interception.base import Decision, InterceptionPolicy, PausedRequest, StepState


class DiscardPolicy(InterceptionPolicy):
    """vLLM today: the pause ends the request; the resumption queues at the back and recomputes."""
    name = "discard"
    keeps_arrival_time = False

    def decide(self, paused: list[PausedRequest], state: StepState) -> dict[str, Decision]:
        return {p.request.request_id: Decision(Disposition.DISCARD) for p in paused}


class ImprovedDiscardPolicy(DiscardPolicy):
    """Discard, but the resumed request keeps its original place in the queue."""
    name = "improved-discard"
    keeps_arrival_time = True


class PreservePolicy(InterceptionPolicy):
    name = "preserve"
    acts_on_paused = False

    def decide(self, paused: list[PausedRequest], state: StepState) -> dict[str, Decision]:
        return {}


class SwapPolicy(InterceptionPolicy):
    """Swap the whole context out at once and back at resume (the synchronous baseline: copies
    beyond the step's free swap limit stall the iteration, which waste accounting records)."""
    name = "swap"

    def decide(self, paused: list[PausedRequest], state: StepState) -> dict[str, Decision]:
        return {p.request.request_id: Decision(Disposition.SWAP, p.device_tokens) for p in paused}
