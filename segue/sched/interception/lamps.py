"""LAMPS handling (paper 001 §4.2): the disposition of an interception is predicted *before* it
happens, from the predicted pre-API length and API duration, and applied as predicted, instead of
being re-decided every step from the time paused so far (InferCept's min-waste).

The choice is shared with the LAMPS ordering policy (segue/sched/policies/lamps.py) through
`Request.predicted_disposition`: the ordering policy ranks a request by the memory-over-time of the
handling it predicts and writes that handling there; this policy applies it. Combinations:

- ``--policy lamps --interception-policy lamps``: the paper's LAMPS (ranking and handling agree).
- ``--policy lamps --interception-policy min-waste``: ablation "scheduling only" — LAMPS ranks as if
  its predicted handling will happen, but InferCept decides the handling at run time.
- ``--policy fcfs --interception-policy lamps``: "LAMPS w/o scheduling" (§6.3). No ordering policy
  predicts a handling, so this policy predicts it itself when the interception begins, with the
  same equations, the request's `predicted_interception_s` and the step's measured batch, and
  keeps it for the whole interception.

A request with neither a stored handling nor a predicted duration falls back to min-waste's
per-step choice (with the tool's known duration or the dynamic estimate).

Swap is applied through the per-step swap-out budget (InferCept's chunked swap), largest contexts
first; a context the budget cannot take at once is discarded instead when that wastes less than
holding it for the rest of its predicted pause, and otherwise keeps draining in later steps.

Waste equations, in byte-seconds, for a context of C tokens paused for d seconds:

- preserve: d·C·M (InferCept eq. 2);
- discard: chunked recomputation, InferCept eq. 4 (this engine recomputes in chunks);
- swap, ``"chunked"`` (default): this engine's swap is budgeted and overlaps the step, so no one
  stalls; the request holds its context while it drains out and while it comes back, about
  T_swap(C)·C·M/2 each way, T_swap(C)·C·M in all;
- swap, ``"sync"``: InferCept eq. 3, 2·T_swap(C)·(C + C_other)·M, for a copy that stalls the batch.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from segue.request import Disposition, Interception
from segue.sched.cost_model import CostModel
from segue.sched.interception.base import Decision, InterceptionPolicy, PausedRequest, StepState
from segue.sched.interception.min_waste import MinWastePolicy

SWAP_WASTE_MODELS = ("chunked", "sync")
# Ties go to the handling that moves the least data.
_PREFERENCE = (Disposition.PRESERVE, Disposition.SWAP, Disposition.DISCARD)


@dataclass(frozen=True)
class HandlingChoice:
    disposition: Disposition
    waste: float                          # byte-seconds of the chosen handling
    wastes: dict[Disposition, float]      # of every handling, for inspection and tests


def handling_wastes(cost: CostModel, context_tokens: float, duration_s: float, other_tokens: float,
                    num_running: float, swap_waste: str = "chunked") -> dict[Disposition, float]:
    c = max(float(context_tokens), 0.0)
    m = cost.kv_bytes_per_token
    if swap_waste == "chunked":
        swap = cost.t_swap(c) * c * m
    elif swap_waste == "sync":
        swap = 2 * cost.t_swap(c) * (c + other_tokens) * m
    else:
        raise ValueError(f"swap_waste must be one of {SWAP_WASTE_MODELS}, got {swap_waste!r}")
    return {
        Disposition.PRESERVE: cost.waste_preserve(max(duration_s, 0.0), c),
        Disposition.SWAP: swap,
        Disposition.DISCARD: cost.waste_chunked_discard(round(c), round(other_tokens), round(num_running)),
    }


def choose_handling(cost: CostModel, context_tokens: float, duration_s: float, other_tokens: float,
                    num_running: float, swap_waste: str = "chunked") -> HandlingChoice:
    wastes = handling_wastes(cost, context_tokens, duration_s, other_tokens, num_running, swap_waste)
    best = min(_PREFERENCE, key=lambda d: wastes[d])
    return HandlingChoice(best, wastes[best], wastes)


class LAMPSInterceptionPolicy(InterceptionPolicy):
    name = "lamps"

    def __init__(self, swap_waste: str = "chunked") -> None:
        if swap_waste not in SWAP_WASTE_MODELS:
            raise ValueError(f"swap_waste must be one of {SWAP_WASTE_MODELS}, got {swap_waste!r}")
        self.swap_waste = swap_waste
        self._fallback = MinWastePolicy()
        # Handlings this policy predicted itself, per request, for the interception they belong to.
        self._own: dict[str, tuple[Interception, Disposition]] = {}

    def planned(self, p: PausedRequest, state: StepState) -> Disposition | None:
        """The handling to apply, or None when nothing was predicted (min-waste decides)."""
        req = p.request
        if req.predicted_disposition is not None:
            return req.predicted_disposition
        own = self._own.get(req.request_id)
        if own is not None and own[0] is req.interception:
            return own[1]
        if req.predicted_interception_s is None:
            return None
        assert req.interception is not None  # a paused request has its interception
        # Predicted once, when the interception begins, with the context it actually has.
        choice = choose_handling(state.cost, p.context_tokens, req.predicted_interception_s,
                                 state.running_tokens, state.num_running, self.swap_waste)
        self._own[req.request_id] = (req.interception, choice.disposition)
        return choice.disposition

    def decide(self, paused: list[PausedRequest], state: StepState) -> dict[str, Decision]:
        live = {p.request.request_id for p in paused}
        self._own = {rid: v for rid, v in self._own.items() if rid in live}
        decisions: dict[str, Decision] = {}
        to_swap: list[PausedRequest] = []
        unplanned: list[PausedRequest] = []
        for p in paused:
            plan = self.planned(p, state)
            if plan is None:
                unplanned.append(p)
            elif plan is Disposition.SWAP:
                to_swap.append(p)
            else:
                decisions[p.request.request_id] = Decision(plan)
        # Budgeted swap, largest contexts first (they waste the most while held). When the budget
        # cannot take the whole context, discard it instead if that wastes less than holding it
        # for the rest of the predicted pause (InferCept's eq. 5 hybrid); otherwise the rest
        # waits on the device for later budget.
        budget = state.swap_out_budget
        for p in sorted(to_swap, key=lambda p: p.device_tokens, reverse=True):
            rid = p.request.request_id
            if p.device_tokens > budget and self._discard_is_cheaper(p, state):
                decisions[rid] = Decision(Disposition.DISCARD)
                continue
            take = min(budget, p.device_tokens)
            budget -= take
            decisions[rid] = Decision(Disposition.SWAP, take)
        if unplanned:
            decisions.update(self._fallback.decide(unplanned, replace(state, swap_out_budget=budget)))
        return decisions

    @staticmethod
    def _discard_is_cheaper(p: PausedRequest, state: StepState) -> bool:
        predicted = p.request.predicted_interception_s
        left_s = max(predicted - p.elapsed_s, 0.0) if predicted is not None else p.elapsed_s
        discard = state.cost.waste_chunked_discard(p.device_tokens, state.running_tokens, state.num_running)
        return discard < state.cost.waste_preserve(left_s, p.device_tokens)
