"""Reliability, short form for CI: a bounded soak of a live server under a mix of normal and faulty
clients (tests/soak), then fuzzing of every endpoint, none of which may answer 5xx.

The app's OpenAPI schema declares the generation endpoints' request bodies (segue/server/openapi.py).
The fuzz (1) hands schemathesis that schema with the bodies tightened so that valid ones stay
short (see _tighten), and (2) fuzzes the two generation endpoints by hand with hypothesis: valid
requests with random JSON of any type in any field, random messages and raw bytes.

One engine-level test replays the workload on which the soak's stall detector found a scheduler
deadlock (partly swapped-in and waiting requests holding the whole device pool, nothing running),
so that it stays fixed.
"""
from __future__ import annotations

import copy
import json
import pathlib
import random
from collections import Counter
from typing import Any, Iterator

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from schemathesis.checks import not_a_server_error

import server_helpers as support
from conftest import make_tiny_checkpoint
from segue.config import CacheConfig, EngineConfig, ModelLoadConfig, SchedulerConfig
from segue.engine.async_engine import AsyncLLMEngine
from segue.engine.engine_request import EngineRequest
from segue.engine.llm_engine import LLMEngine
from segue.sampling_params import SamplingParams
from segue.server.app import create_app
from segue.server.config import ServerConfig
from segue.server.request_bodies import ChatCompletionRequest, CompletionRequest
from segue.sim.script import scripted
from segue.sim.trace import TraceSegment
from soak import server as soak_server
from soak.driver import SoakConfig, run_soak
from soak.server import soak_tools

# ~500 requests take well under a minute on 2 cores and still hit every fault kind many times.
SHORT_SOAK = SoakConfig(requests=500, concurrency=16, seconds=50)
FAULT_KINDS = ("tool_raises", "tool_times_out", "disconnect_mid_stream", "client_timeout", "task_cancelled",
               "malformed_request", "session_abandoned", "session_closed_while_held", "history_edited")
EXAMPLES_PER_OPERATION = 40
HAND_FUZZ_EXAMPLES = 120
# Fuzzed generations stay short: the point is the input handling, not the decode loop.
FUZZ_MAX_TOKENS = 16


@pytest.mark.slow
def test_short_soak_leaves_nothing_behind() -> None:
    report = run_soak(SHORT_SOAK)
    print("\n" + report.markdown())
    assert not report.problems(), report.markdown()
    assert report.requests >= 0.9 * SHORT_SOAK.requests, f"only {report.requests} requests in the time budget"
    missing = [kind for kind in FAULT_KINDS if not report.faults.get(kind)]
    assert not missing, f"fault kinds never injected: {missing}"


# (prompt tokens, [(generate, tool seconds, result tokens), ...], final generate): after the soak
# stalled at a 512-token pool, a random search over engine-level scripts found this one (seed 1).
STALL_WORKLOAD = [(30, [(4, 0.05, 7), (1, 0.05, 8), (4, 0.05, 4)], 5), (6, [(6, 0.0, 7), (1, 0.05, 0), (5, 0.3, 6)], 5),
                  (22, [(9, 0.05, 7)], 4), (24, [(5, 0.3, 2)], 4), (27, [(4, 0.3, 8), (1, 0.3, 4), (2, 0.0, 4)], 3),
                  (9, [(7, 0.0, 5)], 2), (20, [(9, 0.05, 8), (3, 0.3, 3)], 5)]


def test_engine_progresses_when_held_contexts_fill_the_pool(tmp_path: pathlib.Path) -> None:
    engine = LLMEngine(EngineConfig(
        model=ModelLoadConfig(model=str(make_tiny_checkpoint(tmp_path / "tiny")), dtype="float32", device="cpu"),
        cache=CacheConfig(block_size=4, kv_cache_tokens=64, swap_space_tokens=1024),
        scheduler=SchedulerConfig(max_num_batched_tokens=48, interception_policy="min-waste")))
    now = [0.0]
    engine.clock = lambda: now[0]  # tool durations in steps, not in wall time: the same run everywhere
    rng = random.Random(0)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(100, 40000) for _ in range(n)]
    for i, (prompt, tools, last) in enumerate(STALL_WORKLOAD):
        script = [TraceSegment(g, s, tokens(n), kind="tool") for g, s, n in tools] + [TraceSegment(last)]
        request = EngineRequest(tokens(prompt), SamplingParams(temperature=0, ignore_eos=True), f"r{i}")
        scripted(engine).add_request(request, script)
    for _ in range(3000):
        if not engine.has_unfinished_requests():
            break
        engine.step()
        now[0] += 0.01
    assert not engine.has_unfinished_requests(), "\n".join(soak_server.queue_dump(engine))


# ---- fuzzing -------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def fuzz_engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[AsyncLLMEngine]:
    # A 512-token context bounds how long any accepted request can generate.
    engine = support.make_async_engine(tmp_path_factory.mktemp("fuzz"), "min-waste", context=512)
    yield engine
    support.shutdown(engine)


def fuzz_app(engine: AsyncLLMEngine) -> Any:
    config = ServerConfig(request_timeout_s=60.0, max_body_bytes=64 * 1024, session_ttl_s=5.0)
    return create_app(engine, config=config, tools=soak_tools())


def _tighten(schema: dict[str, Any], model_name: str) -> None:
    """Valid bodies name a small max_tokens: left out, it defaults to the rest of the context, and
    every accepted example would spend a second decoding. The model is pinned to what the server
    serves, or nearly no generated body would get past it, and n kept small (each choice is a
    generation). Negative mode still violates all three."""
    props = schema["properties"]
    props["max_tokens"] = {"type": "integer", "minimum": 1, "maximum": FUZZ_MAX_TOKENS}
    props["model"] = {"anyOf": [{"type": "null"}, {"const": model_name}]}
    props["n"] = {"anyOf": [{"type": "null"}, {"type": "integer", "minimum": 1, "maximum": 3}]}
    schema["required"] = sorted(set(schema.get("required", [])) | {"max_tokens"})
    schema["properties"].pop("max_completion_tokens", None)  # it would override max_tokens


def with_request_bodies(openapi: dict[str, Any], model_name: str) -> dict[str, Any]:
    """The app's schema with the generation endpoints' declared bodies tightened (see _tighten)."""
    doc = copy.deepcopy(openapi)
    for path in ("/v1/chat/completions", "/v1/completions"):
        content = doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]
        schema = copy.deepcopy(doc["components"]["schemas"][content["schema"]["$ref"].rsplit("/", 1)[1]])
        _tighten(schema, model_name)
        content["schema"] = schema
    return doc


def _integral_max_tokens(case: Any) -> Any:
    # JSON Schema counts 5.0 as an integer and hypothesis-jsonschema sends it; the server's strict
    # models rightly refuse it (400), which would keep most valid bodies from ever reaching the engine.
    body = case.body
    if isinstance(body, dict) and isinstance(body.get("max_tokens"), float) and body["max_tokens"].is_integer():
        body["max_tokens"] = int(body["max_tokens"])
    return case


@pytest.mark.slow
def test_openapi_fuzz_has_no_server_errors(fuzz_engine: AsyncLLMEngine) -> None:
    app = fuzz_app(fuzz_engine)
    # What /openapi.json serves from now on.
    app.openapi_schema = with_request_bodies(app.openapi(), app.state.serving.model_name)
    schema = schemathesis.openapi.from_asgi("/openapi.json", app)
    failures: list[str] = []
    statuses: Counter = Counter()
    try:
        for result in schema.get_all_operations():
            operation = result.ok()
            modes = [schemathesis.GenerationMode.POSITIVE]
            if operation.body:  # schema-violating bodies, where there is a body to violate
                modes.append(schemathesis.GenerationMode.NEGATIVE)
            for mode in modes:
                strategy = operation.as_strategy(generation_mode=mode)
                if mode is schemathesis.GenerationMode.POSITIVE:
                    strategy = strategy.map(_integral_max_tokens)

                @given(case=strategy)
                @settings(max_examples=EXAMPLES_PER_OPERATION, deadline=None, derandomize=True, database=None,
                          phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
                def probe(case: Any) -> None:
                    response = case.call()
                    statuses[f"{operation.label} {response.status_code}"] += 1  # noqa: B023 -- probe() runs in this iteration
                    try:
                        case.validate_response(response, checks=[not_a_server_error])
                    except Exception as e:  # a check failure; collected so one run shows them all
                        failures.append(f"{case.as_curl_command()} -> {response.status_code}: {e}")
                probe()
    finally:
        # The in-process transport keeps the app's lifespan open; end it before the engine goes.
        from schemathesis.python.asgi import shutdown_lifespans
        shutdown_lifespans()
    print("\nschemathesis statuses:", dict(sorted(statuses.items())))
    assert sum(statuses.values()) > 100
    assert not failures, "\n".join(failures[:10])
    support.wait_idle(fuzz_engine, timeout=30)


_scalars = st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats() | st.text(max_size=12)
json_values = st.recursive(_scalars, lambda inner: st.lists(inner, max_size=3)
                           | st.dictionaries(st.text(max_size=8), inner, max_size=3), max_leaves=8)
CHAT_FIELDS = sorted(ChatCompletionRequest.model_fields)
COMPLETION_FIELDS = sorted(CompletionRequest.model_fields)
MESSAGE_FIELDS = ["role", "content", "name", "tool_calls", "tool_call_id"]
messages = st.lists(st.dictionaries(st.sampled_from(MESSAGE_FIELDS), json_values | st.sampled_from(
    ["user", "assistant", "tool", "system", "developer"]), max_size=5), max_size=3)


@st.composite
def bodies(draw: st.DrawFn, fields: list[str], base: dict[str, Any]) -> Any:
    """A valid request with a few fields replaced by random JSON; sometimes not an object at all."""
    if draw(st.integers(0, 9)) == 0:
        return draw(json_values)
    body = dict(base)
    for name in draw(st.lists(st.sampled_from(fields), min_size=1, max_size=4, unique=True)):
        body[name] = draw(messages) if name == "messages" and draw(st.booleans()) else draw(json_values)
    # Any accepted request must still end quickly: integer budgets are clamped (schemathesis sends
    # out-of-range ones), and a max_tokens that is not one gets the default.
    for name in ("max_tokens", "max_completion_tokens"):
        value = body.get(name)
        if isinstance(value, int) and not isinstance(value, bool) and not 0 < value <= FUZZ_MAX_TOKENS:
            body[name] = FUZZ_MAX_TOKENS
    if not isinstance(body.get("max_tokens"), int) or isinstance(body["max_tokens"], bool):
        body["max_tokens"] = FUZZ_MAX_TOKENS
    return body


@pytest.fixture(scope="module")
def fuzz_server(fuzz_engine: AsyncLLMEngine) -> Iterator[str]:
    with support.ServerThread(fuzz_app(fuzz_engine)) as server:
        yield server.url


@pytest.mark.slow
@pytest.mark.parametrize("path,fields,base", [
    ("/v1/chat/completions", CHAT_FIELDS, {"messages": [{"role": "user", "content": "hi"}]}),
    ("/v1/completions", COMPLETION_FIELDS, {"prompt": "hi"}),
])
def test_hand_fuzzed_bodies_have_no_server_errors(fuzz_server: str, fuzz_engine: AsyncLLMEngine, path: str,
                                                  fields: list[str], base: dict[str, Any]) -> None:
    statuses: Counter = Counter()
    with httpx.Client(base_url=fuzz_server, timeout=60) as http:
        @given(body=bodies(fields, base), raw=st.none() | st.binary(max_size=64))
        @settings(max_examples=HAND_FUZZ_EXAMPLES, deadline=None, derandomize=True, database=None,
                  suppress_health_check=list(HealthCheck))
        def probe(body: Any, raw: bytes | None) -> None:
            if raw is not None and raw[:1] == b"\x00":  # now and then, bytes that are not JSON at all
                response = http.post(path, content=raw)
            else:  # NaN and infinities too, which httpx's json= refuses and Python's json writes
                response = http.post(path, content=json.dumps(body), headers={"content-type": "application/json"})
            statuses[response.status_code] += 1
            assert response.status_code < 500, f"{body!r} -> {response.status_code}: {response.text[:300]}"
            if response.status_code >= 400:
                assert "error" in response.json(), response.text[:300]
        probe()
    print(f"\n{path} statuses:", dict(sorted(statuses.items())))
    assert statuses[200] > 0, "no fuzzed request was valid: the fuzz never reached the engine"
    support.wait_idle(fuzz_engine, timeout=30)
