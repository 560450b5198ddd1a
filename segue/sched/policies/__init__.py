"""Ordering policies, chosen by name."""
from __future__ import annotations

from segue.sched.policies.base import PolicyContext, SchedulingPolicy
from segue.sched.policies.fcfs import FCFSPolicy

POLICIES: dict[str, type[SchedulingPolicy]] = {cls.name: cls for cls in (FCFSPolicy,)}


def make_policy(name: str, context: PolicyContext | None = None) -> SchedulingPolicy:
    try:
        cls = POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown scheduling policy {name!r}; choose from {sorted(POLICIES)}") from None
    return cls(context)


__all__ = ["POLICIES", "PolicyContext", "SchedulingPolicy", "make_policy"]
