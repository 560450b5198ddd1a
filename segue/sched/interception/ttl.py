"""TTL retention (Continuum / CacheTTL): keep a paused context on the device for a time limit
picked from that tool's observed durations, then swap it out (or discard it without host space).
Short, predictable tools resume with their KV in place; long or unknown waits release memory."""
from __future__ import annotations

from typing import Callable

from segue.request import Disposition
from segue.sched.interception.base import Decision, InterceptionPolicy, PausedRequest, StepState


class TTLPolicy(InterceptionPolicy):
    name = "ttl"

    def __init__(self, quantile_fn: Callable[[str | None, float], float | None] | None = None,
                 quantile: float = 0.9, default_ttl_s: float = 1.0, max_ttl_s: float = 30.0) -> None:
        # quantile_fn(tool, q): the q-quantile of the tool's observed durations, or None.
        self.quantile_fn = quantile_fn
        self.quantile = quantile
        self.default_ttl_s = default_ttl_s
        self.max_ttl_s = max_ttl_s

    def ttl(self, p: PausedRequest) -> float:
        observed = None
        if self.quantile_fn is not None and p.request.interception is not None:
            observed = self.quantile_fn(p.request.interception.tool, self.quantile)
        if observed is None:
            observed = p.expected_s if p.expected_s is not None else self.default_ttl_s
        return min(observed, self.max_ttl_s)

    def decide(self, paused: list[PausedRequest], state: StepState) -> dict[str, Decision]:
        budget = state.swap_out_budget
        decisions = {}
        for p in sorted(paused, key=lambda p: p.elapsed_s, reverse=True):
            if p.elapsed_s < self.ttl(p):
                continue
            if budget > 0:
                take = min(budget, p.device_tokens)
                budget -= take
                decisions[p.request.request_id] = Decision(Disposition.SWAP, take)
            elif p.host_tokens == 0:
                decisions[p.request.request_id] = Decision(Disposition.DISCARD)
        return decisions
