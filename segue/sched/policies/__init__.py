"""Ordering policies, chosen by name."""
from __future__ import annotations

from segue.sched.policies.base import PolicyContext, SchedulingPolicy
from segue.sched.policies.fcfs import FCFSPolicy
from segue.sched.policies.lamps import LAMPSPolicy
from segue.sched.policies.mlfq import MLFQPolicy
from segue.sched.policies.program_las import ProgramLASPolicy

POLICIES: dict[str, type[SchedulingPolicy]] = {cls.name: cls for cls in (FCFSPolicy, MLFQPolicy)}
POLICIES[LAMPSPolicy.name] = LAMPSPolicy
POLICIES[ProgramLASPolicy.name] = ProgramLASPolicy


def make_policy(name: str, context: PolicyContext | None = None) -> SchedulingPolicy:
    try:
        cls = POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown scheduling policy {name!r}; choose from {sorted(POLICIES)}") from None
    return cls(context)


__all__ = ["POLICIES", "PolicyContext", "SchedulingPolicy", "make_policy"]
