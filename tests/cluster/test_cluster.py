"""EnginePool over two replicas of the tiny model: in process and as Ray actors on a local cluster.

Every test runs on both backends (the Ray one is one module-scoped cluster, num_cpus=2): placement
by session and prefix, outputs equal to one engine's greedy outputs, abort and detach/continue
across the replica boundary, KV freed and engine invariants held afterwards, a clean shutdown.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import math
import sys
from typing import Any, Iterator

import httpx
import pytest
import ray.cloudpickle

from conftest import make_tiny_checkpoint
from segue.cluster import build_local_pool, build_ray_pool
from segue.cluster.local_replica import LocalReplica
from segue.cluster.pool import EnginePool
from segue.cluster.ray_runtime import start_local_ray
from segue.cluster.replica import EngineReplica, engine_census
from segue.cluster.router import LoadReport, PlacementReason
from segue.config import EngineConfig, ModelLoadConfig
from segue.engine.async_engine import AsyncLLMEngine, EngineDeadError
from segue.engine.calls import Abandon, Abort, EngineCall, ExpectResume, GetStats, HeldTokens
from segue.engine.engine_request import EngineRequest, RequestHints
from segue.engine.llm_engine import LLMEngine
from segue.outputs import RequestOutput
from segue.sampling_params import InvalidRequestError, SamplingParams
from segue.server.app import create_app
from segue.tools.call_format import HERMES
from server_helpers import ServerThread

# Ray actors unpickle this module's functions and classes by value: tests are not importable there.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

GREEDY = dict(temperature=0.0, ignore_eos=True)
SYSTEM = "You are a careful assistant. Follow the house rules below in every answer you give. " * 3
PROMPTS = [SYSTEM + "Question one?", "Unrelated text about boats and rivers.", SYSTEM + "Question two?",
           "A third, distinct request."]


class WritesCalls:
    """A replica's model, except that request `rid` writes the token ids `call` (a Hermes tool call)
    over and over for its first `calls` calls: the tiny random model writes none of its own. The
    engine's parser, built from the request's tool format, finds each one and pauses there."""

    def __init__(self, engine: LLMEngine, rid: str, call: list[int], calls: int) -> None:
        self.real = engine.executor.execute
        self.rid, self.call, self.calls = rid, call, calls

    def execute(self, out: Any) -> Any:
        sampled = self.real(out)
        for seq in out.seqs:
            n = seq.request.num_generated_tokens  # the tokens it wrote before this one
            if seq.sample and seq.request.request_id == self.rid and n < self.calls * len(self.call):
                sampled[self.rid] = dataclasses.replace(sampled[self.rid], token_id=self.call[n % len(self.call)])
        return sampled


def install_calls(engine: LLMEngine, rid: str, call: list[int], calls: int) -> None:
    engine.executor.execute = WritesCalls(engine, rid, call, calls).execute  # type: ignore[method-assign]


def uninstall_calls(engine: LLMEngine) -> None:
    del engine.executor.execute  # the executor's own method again


@pytest.fixture(scope="module")
def config(tmp_path_factory: pytest.TempPathFactory) -> EngineConfig:
    path = make_tiny_checkpoint(tmp_path_factory.mktemp("cluster") / "tiny-llama")
    return EngineConfig(model=ModelLoadConfig(model=str(path), dtype="float32", device="cpu"))


@pytest.fixture(scope="module")
def reference(config: EngineConfig) -> dict[str, list[int]]:
    """Greedy token ids of one engine, one prompt at a time."""
    async def run() -> dict[str, list[int]]:
        engine = AsyncLLMEngine.from_config(config)
        try:
            return {p: (await collect(engine.generate(EngineRequest(p, SamplingParams(max_tokens=12, **GREEDY)))))[-1]
                    .outputs[0].token_ids for p in PROMPTS}
        finally:
            await engine.shutdown()
    return asyncio.run(run())


@pytest.fixture(scope="module", params=["local", "ray"])
def pool(request: pytest.FixtureRequest, config: EngineConfig) -> Iterator[EnginePool]:
    stop = None
    if request.param == "local":
        p = build_local_pool(config, 2)
    else:
        stop = start_local_ray(2)
        p = build_ray_pool(config, 2, num_cpus=2)
    yield p
    asyncio.run(p.shutdown())
    if stop is not None:
        stop()


async def ask(target: EnginePool | EngineReplica, op: EngineCall[Any]) -> Any:
    """A call's answer, on a loop of its own (an engine's call() may need a running loop)."""
    return await target.call(op)


async def collect(gen: Any) -> list[RequestOutput]:
    return [out async for out in gen]


async def run_one(pool: EnginePool, prompt: str | list[int], rid: str, max_tokens: int = 12,
                  **hints: Any) -> tuple[int, RequestOutput]:
    """(replica that served it, final output)."""
    owner, last = -1, None
    request = EngineRequest(prompt, SamplingParams(max_tokens=max_tokens, **GREEDY), rid, hints=RequestHints(**hints))
    async for out in pool.generate(request):
        last = out
        if owner < 0:
            owner = pool.owner_of(rid)
    assert last is not None and last.finished
    return owner, last


IDLE = {"requests": 0, "held_blocks": 0, "paused": 0}


async def census_of(pool: EnginePool) -> list[dict[str, int]]:
    return [await r.run_sync(engine_census) for r in pool.replicas]


def census(pool: EnginePool) -> list[dict[str, int]]:
    return asyncio.run(census_of(pool))


def assert_idle(pool: EnginePool, timeout: float = 20.0) -> None:
    """Every request gone and every KV block back, engine invariants intact. Aborts travel to the
    replicas' loop threads, so this waits for them (bounded: the cores are shared)."""
    async def wait() -> list[dict[str, int]]:
        deadline = asyncio.get_running_loop().time() + timeout
        while (seen := await census_of(pool)) != [IDLE] * len(pool.replicas):
            if asyncio.get_running_loop().time() > deadline:
                return seen
            await asyncio.sleep(0.05)
        await pool.run_sync(LLMEngine.check_invariants)
        return seen
    assert asyncio.run(wait()) == [IDLE] * len(pool.replicas)
    assert pool.num_unfinished_requests == 0


def test_outputs_equal_single_engine_greedy(pool: EnginePool, reference: dict[str, list[int]]) -> None:
    async def run() -> list[tuple[int, RequestOutput]]:
        return await asyncio.gather(*(run_one(pool, p, f"eq-{i}") for i, p in enumerate(PROMPTS)))
    results = asyncio.run(run())
    for prompt, (_, out) in zip(PROMPTS, results, strict=True):
        assert out.outputs[0].token_ids == reference[prompt]
        assert out.prompt == prompt
    assert {owner for owner, _ in results} == {0, 1}  # concurrent unrelated work uses both engines
    assert_idle(pool)


def test_session_stays_on_its_replica(pool: EnginePool) -> None:
    home, _ = asyncio.run(run_one(pool, "Turn one of a session.", "s-1", program_id="sess-A"))
    # Its replica now looks much busier: the session still goes home, other work goes elsewhere.
    pool.router.report_load(home, LoadReport(running=20))
    for turn in range(2, 4):
        owner, _ = asyncio.run(run_one(pool, f"Turn {turn}, different words.", f"s-{turn}", program_id="sess-A"))
        assert owner == home
    pool.router.report_load(home, LoadReport(running=20))
    other, _ = asyncio.run(run_one(pool, "Somebody else entirely.", "x-1", program_id="sess-B"))
    assert other != home
    assert_idle(pool)


def test_closed_program_is_unbound(pool: EnginePool) -> None:
    """Closing a session or deleting a program unbinds it: its replica is not chosen for it any more."""
    home, _ = asyncio.run(run_one(pool, "Turn one of a closing session.", "c-1", program_id="sess-C"))
    pool.forget_program("sess-C")
    pool.router.report_load(home, LoadReport(running=20))
    owner, _ = asyncio.run(run_one(pool, "A new conversation under the old id.", "c-2", program_id="sess-C"))
    assert owner != home
    pool.router.report_load(home, LoadReport(running=0))
    assert_idle(pool)


def test_prefix_sharing_pair_lands_together(pool: EnginePool) -> None:
    first, a = asyncio.run(run_one(pool, SYSTEM + "Alpha?", "p-a"))
    pool.router.report_load(first, LoadReport(running=2))  # busier, but within the router's slack
    before = pool.router.placements[PlacementReason.PREFIX]
    second, b = asyncio.run(run_one(pool, SYSTEM + "Beta, please?", "p-b"))
    assert second == first
    assert pool.router.placements[PlacementReason.PREFIX] == before + 1
    block = 16
    assert b.num_cached_tokens >= block  # the engine really served the shared blocks from cache
    assert_idle(pool)


def test_abort_frees_kv_on_the_replica(pool: EnginePool) -> None:
    async def run() -> RequestOutput:
        outputs = []
        async for out in pool.generate(EngineRequest(SYSTEM + "Go on and on.", SamplingParams(max_tokens=400, **GREEDY),
                                                     "ab-1")):
            outputs.append(out)
            if len(outputs) == 2:
                pool.call(Abort("ab-1"))
        return outputs[-1]
    last = asyncio.run(run())
    assert last.finished and last.outputs[0].finish_reason == "abort"
    assert pool.owner_of("ab-1") is None
    assert_idle(pool)

    async def leave_early() -> None:  # a client that disconnects: closing the stream aborts
        gen = pool.generate(EngineRequest("Another long one.", SamplingParams(max_tokens=400, **GREEDY), "ab-2"))
        await gen.__anext__()
        await gen.aclose()
        await asyncio.sleep(0.2)  # the replica delivers the aborted output to this loop: keep it open
    asyncio.run(leave_early())
    assert_idle(pool)


def _latency_sensitive(rid: str) -> Any:
    return lambda llm: llm.scheduler.state.requests[rid].latency_sensitive


def test_objective_updates_reach_the_replica(pool: EnginePool) -> None:
    """A program call's objective can change after launch (its reduce arrived): the pool forwards
    it to the replica holding the request, and keeps one that comes before placement."""
    async def run() -> list[bool]:
        seen = []
        pool.set_latency_sensitive("obj-1", False)  # before the request exists
        async for _ in pool.generate(EngineRequest(SYSTEM + "Go on and on.", SamplingParams(max_tokens=400, **GREEDY),
                                                   "obj-1")):
            if not seen:
                seen.append(await pool.run_sync(_latency_sensitive("obj-1"), request_id="obj-1"))
                pool.set_latency_sensitive("obj-1", True)
            elif len(seen) == 1:
                value = await pool.run_sync(_latency_sensitive("obj-1"), request_id="obj-1")
                if value:  # applied between two steps
                    seen.append(value)
                    pool.call(Abort("obj-1"))
        return seen
    assert asyncio.run(run()) == [False, True]
    assert_idle(pool)


def test_detached_request_continues_on_its_replica(pool: EnginePool) -> None:
    call = pool.encode('<tool_call>{"name": "lookup", "arguments": {}}</tool_call>')
    asyncio.run(pool.run_sync(functools.partial(install_calls, rid="d-1", call=call, calls=2)))

    async def first_turn() -> RequestOutput:
        request = EngineRequest("Call a tool, please.", SamplingParams(max_tokens=len(call) + 8, **GREEDY), "d-1",
                                tool_format=HERMES)
        async for out in pool.generate(request):
            if out.paused:
                pool.detach("d-1")  # what the server does when a turn ends on client-side tool calls
                return out
        raise AssertionError("the request never paused")
    try:
        paused = asyncio.run(first_turn())
        assert paused.outputs[0].tool_calls[0].name == "lookup"
        home = pool.owner_of("d-1")
        assert census(pool)[home]["paused"] == 1  # held on its replica, with its KV policy

        async def next_turn(max_tokens: int) -> RequestOutput:
            params = SamplingParams(max_tokens=max_tokens, **GREEDY)
            async for out in pool.continue_request("d-1", [11, 12, 13], params):
                if out.paused:
                    pool.detach("d-1")
                    return out
            return out
        again = asyncio.run(next_turn(len(call) + 8))  # writes its second call
        assert again.paused and not again.finished and pool.owner_of("d-1") == home
        with pytest.raises(InvalidRequestError):
            asyncio.run(collect(pool.continue_request("nope", [1], None)))
        final = asyncio.run(next_turn(3))  # the model's own tokens: no call
        assert final.finished and final.outputs[0].finish_reason == "length"
        ids = final.outputs[0].token_ids
        assert sum(ids[i:i + 3] == [11, 12, 13] for i in range(len(ids))) == 2  # both turns' inputs joined its context
        assert pool.owner_of("d-1") is None
        assert_idle(pool)
    finally:
        asyncio.run(pool.run_sync(uninstall_calls))


def _expected_duration(rid: str) -> Any:
    return lambda llm: llm.scheduler.state.requests[rid].interception.expected_duration


def test_calls_about_a_paused_request_reach_its_replica(pool: EnginePool) -> None:
    """Each EngineCall goes through the pool and the replica (in process, or pickled into a Ray
    actor and back) to the engine's request, and its answer comes back typed; once the request is
    gone the pool answers for it."""
    call = pool.encode('<tool_call>{"name": "lookup", "arguments": {}}</tool_call>')
    asyncio.run(pool.run_sync(functools.partial(install_calls, rid="q-1", call=call, calls=1)))

    async def scenario() -> tuple[Any, ...]:
        request = EngineRequest("Call a tool, please.", SamplingParams(max_tokens=len(call) + 8, **GREEDY), "q-1",
                                tool_format=HERMES)
        paused = None
        async with contextlib.aclosing(pool.generate(request)) as outs:
            async for out in outs:
                if out.paused:
                    pool.detach("q-1")
                    paused = out
                    break
        assert paused is not None, "the request never paused"
        held = await pool.call(HeldTokens("q-1"))
        expected = await pool.call(ExpectResume("q-1", 7.0))
        duration = await pool.run_sync(_expected_duration("q-1"), request_id="q-1")
        abandoned = await pool.call(Abandon("q-1"))
        after = await pool.run_sync(_expected_duration("q-1"), request_id="q-1")
        pool.call(Abort("q-1"))  # not awaited: an abort's answer is ready at once
        gone = (await pool.call(HeldTokens("q-1")), await pool.call(ExpectResume("q-1", 1.0)),
                await pool.call(Abandon("q-1")))
        return paused, held, expected, duration, abandoned, after, gone
    try:
        paused, held, expected, duration, abandoned, after, gone = asyncio.run(scenario())
        assert held == list(paused.prompt_token_ids) + list(paused.outputs[0].token_ids)
        assert expected is True and duration == pytest.approx(7.0)
        assert abandoned is True and after == math.inf
        assert gone == (None, False, False) and pool.owner_of("q-1") is None
        assert_idle(pool)
    finally:
        asyncio.run(pool.run_sync(uninstall_calls))


def test_server_over_the_pool(pool: EnginePool) -> None:
    app = create_app(pool)  # type: ignore[arg-type]  (the pool presents the engine interface)
    with ServerThread(app) as server:
        assert httpx.get(server.url + "/health").json() == {"status": "ok"}
        body = {"model": pool.model_info().model_name, "max_tokens": 5, "temperature": 0, "ignore_eos": True,
                "messages": [{"role": "user", "content": "Hello from the router test."}]}
        reply = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60).json()
        assert reply["usage"]["completion_tokens"] == 5
        metrics = httpx.get(server.url + "/metrics").text
        total = [line for line in metrics.splitlines()
                 if line.startswith('segue_kv_blocks{kind="total",pool="device"}')]
        blocks = [asyncio.run(ask(r, GetStats())).device_blocks_total for r in pool.replicas]
        assert total and float(total[0].split()[-1]) == sum(blocks) > 0  # summed over the replicas
    assert_idle(pool)


def test_snapshot_dead_replica_and_shutdown(pool: EnginePool) -> None:
    snap = asyncio.run(ask(pool, GetStats()))
    per = [asyncio.run(ask(r, GetStats())) for r in pool.replicas]
    assert snap.steps == sum(p.steps for p in per) > 0
    assert snap.device_blocks_total == sum(p.device_blocks_total for p in per)
    assert pool.is_running

    # A replica dies: /health reports it, and new requests go to the survivor.
    dead = pool.replicas[pool.router.least_loaded([0, 1])]  # where the next request would go
    if isinstance(dead, LocalReplica):
        asyncio.run(dead.engine.shutdown())
    else:
        ray.kill(dead.actor)
        # A dead actor is noticed by the first call that reaches it: this one.
        with pytest.raises(EngineDeadError):
            asyncio.run(run_one(pool, "first after the death", "dead-0"))
    assert not dead.is_running and not pool.is_running
    owners = [asyncio.run(run_one(pool, f"survivor {i}", f"dead-{i + 1}"))[0] for i in range(3)]
    assert owners == [1 - dead.index] * 3
    asyncio.run(pool.shutdown())
    assert not pool.is_running
    with pytest.raises(EngineDeadError):
        asyncio.run(run_one(pool, "too late", "late"))
