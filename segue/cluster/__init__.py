"""Several engines behind one server: a router, engine replicas (in process or Ray actors), a pool.

`build_engine(config, n)` is what `segue serve --engines N` runs: one in-process AsyncLLMEngine for
N = 1 (nothing to place), else a local Ray instance with N engine actors behind an EnginePool.
`build_local_pool` puts N engines in this process instead (tests and benchmarks without Ray; the
engines' step threads then share one Python process).

What the server asks of "the engine" is segue/engine/protocol.py's EngineClient, and the pool is
one (see pool.py): the model side (tokenization, chat template, prompt checks) in the server's
process; generate/continue/resume/detach and each call about a request (engine/calls.py) by
request id, on the replica that holds it; GetStats from every live replica, merged by EngineStats.merge.

Fault tolerance: replicas are Ray actors with `max_restarts` (`--engine-restarts`, default
DEFAULT_ENGINE_RESTARTS). When one dies, its requests in flight fail with EngineDeadError (503),
/health turns 503 and new work is routed around it while Ray re-runs the actor's constructor,
which rebuilds the engine. The replica pings it with backoff, without blocking, and is routed to
again once it answers; what it cached is gone, so the router forgets its prefixes and program
bindings (ray_health.py, pool.py). Once restarts are exhausted it stays down, logged as such.

Limits, by design or not yet done:
- a dead replica's held sessions are lost (their next turn starts fresh, or fails with 503 while
  the replica is still down); Ray counts restarts over the actor's lifetime, not per time window;
- the router sees only what it placed and what replicas report with their outputs; an idle
  replica's last report may be one step old;
- program (session) bindings are released when the session closes or the program ends
  (forget_program), else only by LRU (65536 kept);
- `task_group` is a pool hint for in-process callers (programs); the HTTP API does not carry it.
"""
from __future__ import annotations

import dataclasses
import os
from typing import TYPE_CHECKING

from segue.cluster.router import LoadReport, PlacementReason, RouteDecision, Router, RouteRequest
from segue.cluster.routers import make_router

if TYPE_CHECKING:
    from segue.cluster.pool import EnginePool
    from segue.config import EngineConfig
    from segue.engine.async_engine import AsyncLLMEngine

__all__ = ["LoadReport", "PlacementReason", "RouteDecision", "RouteRequest", "Router", "make_router",
           "build_engine", "build_local_pool", "build_ray_pool", "DEFAULT_ENGINE_RESTARTS"]

# Enough to ride out a few crashes; bounded, so an engine that crashes on every rebuild (bad
# hardware, a poison request retried by clients) ends up down and visible instead of flapping.
DEFAULT_ENGINE_RESTARTS = 3


def _router(config: "EngineConfig", num_engines: int, router: str) -> Router:
    options = {"block_size": config.cache.block_size} if router == "affinity" else {}
    return make_router(router, num_engines, **options)


def build_local_pool(config: "EngineConfig", num_engines: int, router: str = "affinity") -> "EnginePool":
    from segue.cluster.local_replica import LocalReplica
    from segue.cluster.pool import EnginePool
    from segue.engine.async_engine import AsyncLLMEngine

    replicas = [LocalReplica(i, AsyncLLMEngine.from_config(config)) for i in range(num_engines)]
    return EnginePool(replicas, _router(config, num_engines, router))


def build_ray_pool(config: "EngineConfig", num_engines: int, router: str = "affinity",
                   num_cpus: int | None = None, max_restarts: int = DEFAULT_ENGINE_RESTARTS) -> "EnginePool":
    """N engine actors on a local Ray instance (started here unless Ray is initialised already).
    Each actor reserves num_cpus / N Ray CPUs, and gets that many torch threads unless --threads
    says otherwise: engines on shared cores must not each spawn a thread per core. Ray restarts a
    crashed actor up to max_restarts times."""
    from segue.cluster.pool import EnginePool
    from segue.cluster.ray_runtime import start_local_ray

    cpus = num_cpus or os.cpu_count() or 1
    stop = start_local_ray(cpus)
    try:
        from segue.cluster.ray_replica import create_ray_replicas

        threads = config.num_threads or max(1, cpus // num_engines)
        replica_config = dataclasses.replace(config, num_threads=threads)
        replicas = create_ray_replicas(replica_config, num_engines, cpus / num_engines, max_restarts)
        return EnginePool(replicas, _router(config, num_engines, router), on_shutdown=stop)
    except BaseException:
        if stop is not None:
            stop()
        raise


def build_engine(config: "EngineConfig", num_engines: int = 1, router: str = "affinity",
                 num_cpus: int | None = None,
                 max_restarts: int = DEFAULT_ENGINE_RESTARTS) -> "AsyncLLMEngine | EnginePool":
    if num_engines < 1:
        raise ValueError(f"--engines must be >= 1, got {num_engines}")
    if num_engines == 1:
        from segue.engine.async_engine import AsyncLLMEngine
        return AsyncLLMEngine.from_config(config)
    return build_ray_pool(config, num_engines, router, num_cpus, max_restarts)
