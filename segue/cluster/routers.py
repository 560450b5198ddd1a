"""Routers by name, as `segue serve --router` and the cluster benchmark choose them. Apart from
router.py so that the interface does not import its implementations."""
from __future__ import annotations

from segue.cluster.affinity_router import AffinityRouter
from segue.cluster.round_robin import RoundRobinRouter
from segue.cluster.router import Router


def make_router(name: str, num_replicas: int, **options: object) -> Router:
    """`affinity` (program, task group, prefix, then load) or `round_robin` (the baseline)."""
    if name == "affinity":
        return AffinityRouter(num_replicas, **options)  # type: ignore[arg-type]
    if name == "round_robin":
        return RoundRobinRouter(num_replicas)
    raise ValueError(f"unknown router {name!r}; choose affinity or round_robin")
