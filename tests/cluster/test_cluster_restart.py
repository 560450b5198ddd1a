"""Ray restarts a crashed engine replica, and the pool takes it back: tiny model, local Ray cluster.

A replica's process is killed the way a crash would (SIGKILL of the actor's worker, or
ray.kill(no_restart=False)): its request in flight fails with EngineDeadError, /health is 503 and new
work goes to the survivor; once Ray has rebuilt the engine the replica serves again, /health is
200 and the router has forgotten what it had placed there. An engine whose loop died inside a live
actor is restarted the same way. With restarts off the replica stays down.
"""
from __future__ import annotations

import asyncio
import logging
import math
import os
import signal
import sys
import time
from typing import Any, Callable, Iterator

import httpx
import pytest
import ray.cloudpickle
from test_cluster import run_one

from conftest import make_tiny_checkpoint
from segue.cluster import build_ray_pool
from segue.cluster.pool import EnginePool
from segue.cluster.ray_replica import RayReplica
from segue.cluster.ray_runtime import start_local_ray
from segue.cluster.replica import engine_census
from segue.cluster.router import LoadReport, PlacementReason
from segue.config import EngineConfig, ModelLoadConfig
from segue.engine.async_engine import EngineDeadError
from segue.engine.engine_request import EngineRequest, RequestHints
from segue.engine.llm_engine import LLMEngine
from segue.outputs import RequestOutput
from segue.sampling_params import SamplingParams
from segue.server.app import create_app
from server_helpers import ServerThread

# Functions below run on the actors via run_sync: they travel by value (tests are not importable there).
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

GREEDY = dict(temperature=0.0, ignore_eos=True)
SYSTEM = "You are a careful assistant. Follow the house rules below in every answer you give. " * 3
RESTART_S = 90.0  # a generous bound for Ray to rebuild an engine on two shared cores


def worker_pid(llm: LLMEngine) -> int:
    return os.getpid()


def _injected_failure() -> bool:
    raise RuntimeError("injected engine loop failure")


def break_loop(llm: LLMEngine) -> None:
    llm.has_unfinished_requests = _injected_failure  # type: ignore[method-assign]


def hint_of(llm: LLMEngine) -> float | None:
    return llm.tool_stats.expected("lookup")


@pytest.fixture(scope="module")
def config(tmp_path_factory: pytest.TempPathFactory) -> EngineConfig:
    path = make_tiny_checkpoint(tmp_path_factory.mktemp("restart") / "tiny-llama")
    return EngineConfig(model=ModelLoadConfig(model=str(path), dtype="float32", device="cpu"), num_threads=1)


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[None]:
    # Three Ray CPUs: the two-replica pool and the one-replica pool fit side by side.
    stop = start_local_ray(3)
    yield
    if stop is not None:
        stop()


@pytest.fixture(scope="module")
def pool(config: EngineConfig, ray_cluster: None) -> Iterator[EnginePool]:
    p = build_ray_pool(config, 2, num_cpus=2, max_restarts=2)
    yield p
    asyncio.run(p.shutdown())


def wait_until(condition: Callable[[], bool], timeout: float = RESTART_S) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


def one(pool: EnginePool, prompt: str, rid: str, **hints: Any) -> tuple[int, RequestOutput]:
    return asyncio.run(run_one(pool, prompt, rid, **hints))


def health(server: ServerThread) -> int:
    return httpx.get(server.url + "/health", timeout=10).status_code


def test_killed_replica_restarts_and_forgets_its_cache(pool: EnginePool) -> None:
    pool.set_tool_hint("lookup", 2.5)
    home, _ = one(pool, SYSTEM + "First question?", "r-1", program_id="sess-Q")
    other = 1 - home
    owner, _ = one(pool, SYSTEM + "Second question?", "r-2", program_id="sess-P")
    assert owner == home and pool.router.prefixes.held_by(home) > 0
    replica = pool.replicas[home]
    assert isinstance(replica, RayReplica) and replica.restarts == 0
    pid = asyncio.run(replica.run_sync(worker_pid))

    async def crash_in_flight() -> None:
        # sess-Q is bound to home; its process dies after the first output.
        gen = pool.generate(EngineRequest("Keep talking.", SamplingParams(max_tokens=400, **GREEDY), "r-3",
                                          hints=RequestHints(program_id="sess-Q")))
        first = await gen.__anext__()
        assert not first.finished and pool.owner_of("r-3") == home
        os.kill(pid, signal.SIGKILL)
        async for _ in gen:
            pass
    with pytest.raises(EngineDeadError):
        asyncio.run(asyncio.wait_for(crash_in_flight(), 30))
    assert pool.owner_of("r-3") is None and replica.health.down is not None
    # Hold the first ping (nothing has polled yet): however fast Ray rebuilds the engine, the replica
    # stays down through the checks below.
    replica.health._retry_at = math.inf

    app = create_app(pool)  # type: ignore[arg-type]
    with ServerThread(app) as server:
        # Down: /health says so, calls by id fail at once, new work (even sess-Q) goes to the survivor.
        assert not replica.is_running and health(server) == 503
        with pytest.raises(EngineDeadError):
            asyncio.run(replica.run_sync(engine_census))
        owner, during = one(pool, "The same words on both engines.", "r-4", program_id="sess-Q")
        assert owner == other

        replica.health._retry_at = 0.0
        wait_until(lambda: health(server) == 200)
        assert pool.is_running and replica.is_running and replica.restarts == 1

    # The rebuilt engine holds nothing: the router forgot its prefixes and its program bindings.
    assert pool.router.prefixes.held_by(home) == 0
    pool.router.report_load(home, LoadReport(running=20))
    before = pool.router.placements[PlacementReason.AFFINITY]
    owner, _ = one(pool, "Third question, new words.", "r-5", program_id="sess-P")
    assert owner == other and pool.router.placements[PlacementReason.AFFINITY] == before

    # It serves again, the same model as before, with the tool hints the server had set.
    pool.router.report_load(home, LoadReport())
    pool.router.report_load(other, LoadReport(running=20))
    owner, again = one(pool, "The same words on both engines.", "r-6")
    assert owner == home and again.outputs[0].token_ids == during.outputs[0].token_ids
    assert asyncio.run(replica.run_sync(hint_of)) == 2.5
    pool.router.report_load(other, LoadReport())
    assert asyncio.run(replica.run_sync(engine_census)) == {"requests": 0, "held_blocks": 0, "paused": 0}


def test_dead_engine_loop_restarts_its_actor(pool: EnginePool) -> None:
    """The step loop dies but the process lives: the actor exits when pinged, so Ray restarts it."""
    replica = pool.replicas[0]
    before = replica.restarts
    asyncio.run(replica.run_sync(break_loop))
    with pytest.raises(EngineDeadError):
        asyncio.run(replica.run_sync(engine_census))
    wait_until(lambda: pool.is_running)
    assert replica.restarts == before + 1
    pool.router.report_load(1, LoadReport(running=20))
    owner, out = one(pool, "After the loop died.", "l-1")
    pool.router.report_load(1, LoadReport())
    assert owner == 0 and len(out.outputs[0].token_ids) == 12


def test_without_restarts_the_replica_stays_down(config: EngineConfig, ray_cluster: None,
                                                 caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.ERROR, logger="segue.cluster.ray_health")
    single = build_ray_pool(config, 1, num_cpus=1, max_restarts=0)
    try:
        replica = single.replicas[0]
        assert isinstance(replica, RayReplica)
        ray.kill(replica.actor, no_restart=False)  # a crash: Ray would restart it if allowed
        with pytest.raises(EngineDeadError):
            one(single, "After the crash.", "z-1")
        wait_until(lambda: not replica.is_running and replica.health.gone, timeout=30)  # is_running polls
        assert not single.is_running and replica.restarts == 0
        assert "gone for good: restarts are off" in caplog.text
        with pytest.raises(EngineDeadError, match="every engine replica is gone"):
            one(single, "Still nobody there.", "z-2")
    finally:
        asyncio.run(single.shutdown())
