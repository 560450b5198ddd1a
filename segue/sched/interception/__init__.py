"""Interception policies, chosen by name: discard, improved-discard, preserve, swap, ttl, min-waste."""
from __future__ import annotations

from segue.sched.interception.base import Decision, InterceptionPolicy, PausedRequest, StepState
from segue.sched.interception.lamps import LAMPSInterceptionPolicy
from segue.sched.interception.min_waste import MinWastePolicy
from segue.sched.interception.simple import DiscardPolicy, ImprovedDiscardPolicy, PreservePolicy, SwapPolicy
from segue.sched.interception.ttl import TTLPolicy

INTERCEPTION_POLICIES: dict[str, type[InterceptionPolicy]] = {
    cls.name: cls for cls in (DiscardPolicy, ImprovedDiscardPolicy, PreservePolicy, SwapPolicy,
                              TTLPolicy, MinWastePolicy, LAMPSInterceptionPolicy)
}


def make_interception_policy(name: str, **kwargs) -> InterceptionPolicy:
    try:
        cls = INTERCEPTION_POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown interception policy {name!r}; choose from {sorted(INTERCEPTION_POLICIES)}") from None
    return cls(**kwargs)


__all__ = ["Decision", "InterceptionPolicy", "PausedRequest", "StepState", "INTERCEPTION_POLICIES",
           "make_interception_policy"]
