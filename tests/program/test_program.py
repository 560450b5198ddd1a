"""Programs (semantic variables and functions): the DAG analysis on hand-built graphs, templates and
transforms, then the /v1/programs API and the client library on a live server with a tiny model.

The live tests script the model's outputs (ScriptedModel), so each step writes a known text and
the tests can check that the next step's prompt really holds the previous step's transformed value.
"""
from __future__ import annotations

import time
from typing import Any, Iterator

import httpx
import pytest

from segue.program import Criteria, CycleError, ProgramGraph, Template, TemplateError, Transform, TransformKind
from segue.program.client import Client, ProgramStepError, json_field, semantic_function
from segue.program.registry import ProgramLimits, ProgramRegistry
from segue.program.state import LimitError, NotFoundError
from segue.program.transforms import TransformError
from segue.server.app import create_app
from server_helpers import ScriptedModel, ServerThread, engine_fixture, wait_idle

KEY_A, KEY_B = "sk-program-a", "sk-program-b"


# ---- pure: DAG and objective deduction ---------------------------------------------------------
def _graph(calls: list[tuple[str, list[str], str]]) -> ProgramGraph:
    g = ProgramGraph()
    for call, inputs, output in calls:
        g.add_call(call, inputs, output)
    return g


def test_chain_latency_propagates_to_every_producer() -> None:
    g = _graph([("c1", ["doc1"], "s1"), ("c2", ["s1", "doc2"], "s2"), ("c3", ["s2", "doc3"], "s3")])
    assert g.deduce()["c1"].criteria is None  # nothing asked yet
    g.set_criteria("s3", Criteria.LATENCY)
    d = g.deduce()
    assert [d[c].criteria for c in ("c1", "c2", "c3")] == [Criteria.LATENCY] * 3
    assert all(d[c].task_group is None for c in d)
    assert d["c1"].priority < 0


def test_parallel_producers_form_a_throughput_task_group() -> None:
    g = _graph([("m0", ["x0"], "s0"), ("m1", ["x1"], "s1"), ("m2", ["x2"], "s2"),
                ("reduce", ["s0", "s1", "s2"], "final"), ("other", ["x0"], "unrelated")])
    g.set_criteria("final", Criteria.LATENCY)
    d = g.deduce()
    assert d["reduce"].criteria is Criteria.LATENCY and d["reduce"].task_group is None
    for m in ("m0", "m1", "m2"):
        assert d[m].criteria is Criteria.THROUGHPUT and d[m].task_group == "reduce"
        assert d[m].priority > d["reduce"].priority
    assert d["other"].criteria is None


def test_dependent_producers_are_not_parallel() -> None:
    # b depends on a and both feed c: only b is c's parallel producer, a is b's lone producer.
    g = _graph([("a", ["x"], "va"), ("b", ["va"], "vb"), ("c", ["va", "vb"], "vc")])
    g.set_criteria("vc", Criteria.LATENCY)
    d = g.deduce()
    assert {c: d[c].criteria for c in d} == {c: Criteria.LATENCY for c in ("a", "b", "c")}
    assert all(o.task_group is None for o in d.values())


def test_throughput_marks_ancestors_and_latency_wins() -> None:
    g = _graph([("a", ["x"], "va"), ("b", ["va"], "vb"), ("c", ["va"], "vc")])
    g.set_criteria("vb", Criteria.THROUGHPUT)
    assert g.deduce()["a"].criteria is Criteria.THROUGHPUT
    g.set_criteria("vc", Criteria.LATENCY)
    d = g.deduce()
    assert d["a"].criteria is Criteria.LATENCY and d["b"].criteria is Criteria.THROUGHPUT
    g.set_criteria("vc", Criteria.THROUGHPUT)  # a get cannot downgrade latency
    assert g.deduce()["c"].criteria is Criteria.LATENCY


def test_cycles_are_rejected() -> None:
    g = _graph([("a", ["x"], "y"), ("b", ["y"], "z")])
    with pytest.raises(CycleError):
        g.check_call(["z"], "x")
    with pytest.raises(CycleError):
        g.check_call(["q"], "q")
    with pytest.raises(ValueError):
        g.check_call(["x"], "z")  # z already has a producer


def test_registry_limits_ownership_and_expiry() -> None:
    reg = ProgramRegistry(ProgramLimits(max_programs=3, max_programs_per_owner=2, idle_ttl_s=10))
    a1 = reg.create("a")
    reg.create("a")
    with pytest.raises(LimitError):
        reg.create("a")
    reg.create("b")
    with pytest.raises(LimitError):
        reg.create("c")
    with pytest.raises(NotFoundError):
        reg.program("b", a1.id)
    assert reg.program("a", a1.id) is a1
    assert reg.expire(now=time.monotonic() + 11) == 3 and not reg.programs


# ---- pure: templates and transforms ------------------------------------------------------------
def test_template_parsing() -> None:
    t = Template.parse("Summarize {{input:doc}} using {{ input:style }} and {{input:doc}}.\n{{output:summary}}\n")
    assert t.input_names == ["doc", "style"] and t.output_name == "summary"
    assert t.render_text({"doc": "D", "style": "S"}) == "Summarize D using S and D.\n"
    ids, ends = t.render_tokens({"doc": "D", "style": "S"}, lambda s: [ord(c) for c in s])
    assert ends[-1] == len(ids) and "".join(map(chr, ids)) == "Summarize D using S and D.\n"
    for bad in ("no output", "{{output:a}} then text", "{{input:x}} {{output:x}}", "{{input:1bad}} {{output:y}}",
                "{{output:a}}{{output:b}}", "{{input:a}} {{ oops }} {{output:b}}"):
        with pytest.raises(TemplateError):
            Template.parse(bad)


def test_transforms() -> None:
    assert Transform(TransformKind.STRIP).apply("  hi \n") == "hi"
    assert Transform(TransformKind.JSON_FIELD, path="a.b.1").apply('Sure: ```{"a": {"b": ["x", "y"]}}```') == "y"
    assert Transform(TransformKind.JSON_FIELD, path="a").apply('{"a": {"n": 1}}') == '{"n": 1}'
    assert Transform(TransformKind.REGEX, pattern=r"score: (\d+)", group=1).apply("the score: 42!") == "42"
    with pytest.raises(TransformError, match="no match"):
        Transform(TransformKind.REGEX, pattern=r"\d+").apply("none here")
    with pytest.raises(TransformError, match="missing"):
        Transform(TransformKind.JSON_FIELD, path="b").apply('{"a": 1}')
    with pytest.raises(TransformError, match="not JSON"):
        Transform(TransformKind.JSON_FIELD, path="a").apply("plain text")
    for kwargs in ({"pattern": "("}, {"pattern": "a", "group": 1}, {"pattern": "x" * 300}):
        with pytest.raises(ValueError):
            Transform(TransformKind.REGEX, **kwargs)


# ---- live server ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def scripted(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Any, ScriptedModel]]:
    yield from engine_fixture(tmp_path_factory)


@pytest.fixture(scope="module")
def server(scripted: tuple[Any, ScriptedModel]) -> Iterator[ServerThread]:
    with ServerThread(create_app(scripted[0], api_keys=[KEY_A, KEY_B])) as s:
        yield s


@pytest.fixture
def http(server: ServerThread) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {KEY_A}"}, timeout=60) as c:
        yield c


def _ok(r: httpx.Response) -> dict[str, Any]:
    assert r.status_code == 200, r.text
    return r.json()


def _error(r: httpx.Response, status: int) -> dict[str, Any]:
    assert r.status_code == status, r.text
    return r.json()["error"]


def _program(http: httpx.Client) -> str:
    return _ok(http.post("/v1/programs", json={}))["id"]


def _var(http: httpx.Client, pid: str, value: str | None = None, name: str = "v") -> str:
    body = {"program_id": pid, "name": name, **({"value": value} if value is not None else {})}
    return _ok(http.post("/v1/programs/variables", json=body))["id"]


def _call(http: httpx.Client, pid: str, template: str, inputs: dict[str, str], **extra: Any) -> dict[str, Any]:
    body = {"program_id": pid, "template": template, "inputs": inputs, "max_tokens": 24, "temperature": 0.0,
            **extra}
    return _ok(http.post("/v1/programs/calls", json=body))


def _prompt_of(model: ScriptedModel, marker: str) -> str:
    ((_, seen),) = model.seen_with(marker)
    return seen.text()


def test_chain_runs_server_side(http: httpx.Client, scripted: tuple[Any, ScriptedModel]) -> None:
    engine, model = scripted
    model.script("CHAIN_ONE", '{"answer": "alpha"}')
    model.script("CHAIN_TWO", "beta! and more")
    model.script("CHAIN_THREE", "  gamma  ")
    pid = _program(http)
    doc = _var(http, pid, "a long document", "doc")
    one = _call(http, pid, "CHAIN_ONE read {{input:doc}}:{{output:a}}", {"doc": doc},
                transforms=[{"type": "json_field", "path": "answer"}])
    two = _call(http, pid, "CHAIN_TWO got {{input:a}}:{{output:b}}", {"a": one["output"]["id"]},
                transforms=[{"type": "regex", "pattern": r"(\w+)!", "group": 1}])
    three = _call(http, pid, "CHAIN_THREE got {{input:b}}:{{output:c}}", {"b": two["output"]["id"]},
                  transforms=[{"type": "strip"}])
    # The client only ever asks for the last variable; the two before it flow on the server.
    final = _ok(http.get(f"/v1/programs/variables/{three['output']['id']}", params={"criteria": "latency"}))
    assert final["status"] == "ready" and final["value"] == "gamma"
    assert "CHAIN_TWO got alpha:" in _prompt_of(model, "CHAIN_TWO")
    assert "CHAIN_THREE got beta:" in _prompt_of(model, "CHAIN_THREE")
    info = _ok(http.get(f"/v1/programs/{pid}"))
    assert [c["status"] for c in info["calls"]] == ["done"] * 3
    assert {c["objective"]["criteria"] for c in info["calls"]} == {"latency"}
    values = {v["name"]: v.get("value") for v in info["variables"]}
    assert values == {"doc": "a long document", "a": "alpha", "b": "beta", "c": "gamma"}
    _ok(http.delete(f"/v1/programs/{pid}"))
    wait_idle(engine)


def test_map_reduce_task_group(http: httpx.Client, scripted: tuple[Any, ScriptedModel]) -> None:
    engine, model = scripted
    pid = _program(http)
    summaries = {}
    for i in range(3):
        model.script(f"MAPPER_{i}", f"part{i}")
        # Chunks go inline: the server makes a variable for each.
        summaries[f"s{i}"] = _call(http, pid, f"MAPPER_{i} summarize {{{{input:c}}}}:{{{{output:s{i}}}}}",
                                   {"c": {"value": f"chunk number {i}"}})["output"]["id"]
    model.script("REDUCER", "all three")
    reduce = _call(http, pid, "REDUCER {{input:s0}} | {{input:s1}} | {{input:s2}}:{{output:final}}", summaries,
                   criteria="latency")
    final = _ok(http.get(f"/v1/programs/variables/{reduce['output']['id']}", params={"timeout": 30}))
    assert final["value"] == "all three"
    assert "REDUCER part0 | part1 | part2:" in _prompt_of(model, "REDUCER")
    assert "MAPPER_1 summarize chunk number 1:" in _prompt_of(model, "MAPPER_1")
    calls = {c["output"]["name"]: c for c in _ok(http.get(f"/v1/programs/{pid}"))["calls"]}
    assert calls["final"]["objective"] == {"criteria": "latency", "task_group": None, "priority": -1}
    for i in range(3):
        assert calls[f"s{i}"]["objective"] == {"criteria": "throughput", "task_group": reduce["id"], "priority": 1}
    # Declared at submit, so the reduce reached the engine with its latency priority.
    assert calls["final"]["engine"]["priority"] == -1
    wait_idle(engine)


def test_failed_step_reaches_the_final_get(http: httpx.Client, scripted: tuple[Any, ScriptedModel]) -> None:
    engine, model = scripted
    model.script("FAILING_ONE", "no digits here")
    pid = _program(http)
    one = _call(http, pid, "FAILING_ONE {{input:x}}:{{output:a}}", {"x": _var(http, pid, "x")},
                transforms=[{"type": "regex", "pattern": r"(\d+)", "group": 1}])
    two = _call(http, pid, "then {{input:a}}:{{output:b}}", {"a": one["output"]["id"]})
    three = _call(http, pid, "then {{input:b}}:{{output:c}}", {"b": two["output"]["id"]})
    err = _error(http.get(f"/v1/programs/variables/{three['output']['id']}"), 424)
    assert err["code"] == "variable_failed" and err["param"] == one["id"]
    assert "no match" in err["message"] and one["id"] in err["message"]
    info = _ok(http.get(f"/v1/programs/{pid}"))
    assert [c["status"] for c in info["calls"]] == ["failed"] * 3
    # The later steps never reached the engine.
    assert all(c["prompt_tokens"] is None for c in info["calls"][1:])
    wait_idle(engine)


def test_errors_and_tenants(http: httpx.Client, server: ServerThread) -> None:
    pid = _program(http)
    x = _var(http, pid, None, "x")
    y = _call(http, pid, "from {{input:x}}:{{output:y}}", {"x": x})["output"]["id"]
    # x is empty; writing it from y would close a cycle.
    err = _error(http.post("/v1/programs/calls", json={"program_id": pid, "template": "{{input:y}} {{output:x}}",
                                                       "inputs": {"y": y}, "output_variable": x}), 400)
    assert "cycle" in err["message"]
    bad = [({"template": "no output here", "inputs": {}}, 400, "output"),
           ({"template": "{{input:q}} {{output:o}}", "inputs": {}}, 400, "missing"),
           ({"template": "{{input:q}} {{output:o}}", "inputs": {"q": "var-nope"}}, 404, "does not exist"),
           ({"template": "a {{output:o}}", "transforms": [{"type": "regex", "pattern": "("}]}, 400, "regex"),
           ({"template": "a {{output:o}}", "max_tokens": "5"}, 400, "max_tokens"),
           ({"template": "a {{output:o}}", "temprature": 1.0}, 400, "temprature")]
    for body, status, words in bad:
        assert words in _error(http.post("/v1/programs/calls", json={"program_id": pid, **body}), status)["message"]
    assert _error(http.post(f"/v1/programs/variables/{y}", json={"value": "v"}), 409)["code"] == "variable_conflict"
    _ok(http.post(f"/v1/programs/variables/{x}", json={"value": "now set"}))
    assert _ok(http.get(f"/v1/programs/variables/{y}", params={"timeout": 30}))["status"] == "ready"
    assert _error(http.get(f"/v1/programs/variables/{y}", params={"criteria": "fast"}), 400)
    # Another API key sees nothing of it: the same 404 as for ids that never existed.
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {KEY_B}"}, timeout=30) as other:
        for r in (other.get(f"/v1/programs/variables/{y}"), other.get(f"/v1/programs/{pid}"),
                  other.post(f"/v1/programs/variables/{x}", json={"value": "mine"}),
                  other.post("/v1/programs/calls", json={"program_id": pid, "template": "x {{output:o}}"}),
                  other.delete(f"/v1/programs/{pid}")):
            _error(r, 404)
        other_pid = _ok(other.post("/v1/programs", json={}))["id"]
        _error(other.post("/v1/programs/calls", json={"program_id": other_pid, "template": "{{input:y}} {{output:o}}",
                                                      "inputs": {"y": y}}), 404)
    _error(httpx.get(f"{server.url}/v1/programs/variables/{y}"), 401)
    _ok(http.delete(f"/v1/programs/{pid}"))
    _error(http.get(f"/v1/programs/variables/{y}"), 404)


def test_program_ids_are_scoped_to_the_api_key(http: httpx.Client, server: ServerThread,
                                               scripted: tuple[Any, ScriptedModel],
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """A program_id named in a completion is the engine's program of that key only: key A's own
    requests join its program's calls; key B naming the same id gets a program of its own."""
    engine = scripted[0]
    seen: list[str | None] = []
    generate = engine.generate

    def recording(request: Any) -> Any:
        seen.append(request.hints.program_id)
        return generate(request)

    monkeypatch.setattr(engine, "generate", recording)
    pid = _program(http)
    body = {"prompt": "scoped program", "max_tokens": 2, "program_id": pid}
    _ok(http.post("/v1/completions", json=body))
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {KEY_B}"}, timeout=60) as other:
        _ok(other.post("/v1/completions", json=body))
        _ok(other.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                      "max_tokens": 2, "program_id": pid}))
    out = _call(http, pid, "scoped call {{output:o}}", {}, max_tokens=2)["output"]["id"]
    assert _ok(http.get(f"/v1/programs/variables/{out}", params={"timeout": 30}))["status"] == "ready"
    a_request, b_request, b_chat, a_call = seen
    assert a_request == a_call and pid in a_request
    assert b_request == b_chat and pid in b_request and b_request != a_request
    _ok(http.delete(f"/v1/programs/{pid}"))
    wait_idle(engine)


def test_delete_cancels_running_calls(http: httpx.Client, scripted: tuple[Any, ScriptedModel]) -> None:
    engine = scripted[0]
    pid = _program(http)
    out = _call(http, pid, "go on forever {{input:x}}{{output:o}}", {"x": _var(http, pid, "x")},
                max_tokens=1500, ignore_eos=True)
    pending = _ok(http.get(f"/v1/programs/variables/{out['output']['id']}", params={"timeout": 0.3}))
    assert pending["status"] == "pending"
    _ok(http.delete(f"/v1/programs/{pid}"))
    wait_idle(engine)


def test_calls_sharing_a_prefix_reuse_its_kv(http: httpx.Client, server: ServerThread,
                                            scripted: tuple[Any, ScriptedModel]) -> None:
    pid = _program(http)  # the executor is made on the first programs request
    stats = server.app.state.programs.stats
    waits = stats.prefix_waits
    doc = _var(http, pid, None, "doc")
    outs = [_call(http, pid, f"{{{{input:doc}}}} Question {i}?{{{{output:a}}}}", {"doc": doc}, max_tokens=2)
            for i in range(3)]
    # Setting the document makes all three ready at the same moment.
    _ok(http.post(f"/v1/programs/variables/{doc}", json={"value": " ".join(f"word{i}" for i in range(150))}))
    for o in outs:
        _ok(http.get(f"/v1/programs/variables/{o['output']['id']}", params={"timeout": 30}))
    calls = _ok(http.get(f"/v1/programs/{pid}"))["calls"]
    # One call computes the document's KV; the others wait for it and read it from the cache.
    assert sorted(c["cached_tokens"] > 0 for c in calls) == [False, True, True]
    assert max(c["cached_tokens"] for c in calls) >= 0.5 * calls[0]["prompt_tokens"]
    assert stats.prefix_waits - waits == 2
    _ok(http.delete(f"/v1/programs/{pid}"))


def test_client_library(server: ServerThread, scripted: tuple[Any, ScriptedModel]) -> None:
    engine, model = scripted
    model.script("LIB_CODE", '{"code": "print(1)"}')
    model.script("LIB_TEST", "assert True")

    @semantic_function(max_tokens=24, transforms=[json_field("code")])
    def write_code(task):  # type: ignore[no-untyped-def]
        """LIB_CODE Write code for {{input:task}}. Code: {{output:code}}"""

    @semantic_function(max_tokens=24)
    def write_test(task, code):  # type: ignore[no-untyped-def]
        """LIB_TEST Test {{input:code}} for {{input:task}}: {{output:test}}"""

    with Client(server.url, api_key=KEY_A) as client:
        with client.program() as p:
            task = p.variable("a snake game")
            code = write_code(task)
            test = write_test(task, code)
            assert test.get(criteria="latency", timeout=30) == "assert True"
            assert code.get() == "print(1)"
            assert "Test print(1) for a snake game:" in _prompt_of(model, "LIB_TEST")
        # A template built at run time takes its inputs as keyword arguments; plain values go inline.
        combine = semantic_function("LIB_JOIN {{input:a}} + {{input:b}}: {{output:ab}}", max_tokens=4)(
            lambda **inputs: None)
        model.script("LIB_JOIN", "joined")
        with client.program() as p:
            assert combine(a=p.variable("one"), b="two").get(timeout=30) == "joined"
            assert "LIB_JOIN one + two:" in _prompt_of(model, "LIB_JOIN")
            timing = p.info()["calls"][0]["timing"]
            assert 0 <= timing["ready"] <= timing["launched"] <= timing["done"]
        with client.program() as p:
            broken = write_test("x", write_code(p.variable(None)))  # its task input is never set
            with pytest.raises(TimeoutError):
                broken.get(timeout=0.5)
        with pytest.raises(ValueError, match="parameters"):
            semantic_function("Do {{input:task}}: {{output:o}}")(lambda other: None)
    wait_idle(engine)


def test_client_reports_step_errors(server: ServerThread, scripted: tuple[Any, ScriptedModel]) -> None:
    scripted[1].script("LIB_BAD", "not json")

    @semantic_function(max_tokens=8, transforms=[json_field("x")])
    def bad(a):  # type: ignore[no-untyped-def]
        """LIB_BAD {{input:a}}{{output:b}}"""

    with Client(server.url, api_key=KEY_A) as client, client.program():
        with pytest.raises(ProgramStepError, match="not JSON") as info:
            bad("input").get(timeout=30)
        assert info.value.step is not None and info.value.step.startswith("call-")


class _HoldingEngine:
    """Keeps every request 'in the engine' until released; records hints and objective updates."""

    def __init__(self) -> None:
        import asyncio
        self.release = asyncio.Event()
        self.sent: dict[str, bool] = {}
        self.groups: dict[str, str | None] = {}
        self.updates: list[tuple[str, bool]] = []

    async def generate(self, request: Any) -> Any:
        from types import SimpleNamespace
        request_id = request.request_id
        self.sent[request_id] = request.hints.latency_sensitive
        self.groups[request_id] = request.hints.task_group
        await self.release.wait()
        yield SimpleNamespace(finished=True, prompt_token_ids=[1], num_cached_tokens=0,
                              outputs=[SimpleNamespace(finish_reason="length", text=f"out-{request_id}")])

    def set_latency_sensitive(self, request_id: str, latency_sensitive: bool) -> None:
        self.updates.append((request_id, latency_sensitive))


def _submit_maps(ex: Any, program_id: str, params: Any) -> list[Any]:
    """Three map calls over literal chunks, each writing its own summary variable s0..s2."""
    from segue.program.state import CallSpec
    return [ex.submit(None, program_id, CallSpec(Template.parse(f"M{i} {{{{input:c}}}}:{{{{output:s{i}}}}}"), {},
                                                 params, literals={"c": f"chunk {i}"}))
            for i in range(3)]


def _submit_reduce(ex: Any, program_id: str, maps: list[Any], params: Any) -> Any:
    """The reduce call that reads the maps' summaries, its answer asked for with latency."""
    from segue.program.state import CallSpec
    return ex.submit(None, program_id,
                     CallSpec(Template.parse("R {{input:s0}} {{input:s1}} {{input:s2}}:{{output:f}}"),
                              {f"s{i}": m.output.id for i, m in enumerate(maps)}, params),
                     criteria=Criteria.LATENCY)


def test_launched_map_calls_learn_they_are_a_throughput_task_group() -> None:
    """Map calls reach the engine before the reduce that groups them exists (a client submits
    them first); once it does, the engine hears that they serve throughput."""
    import asyncio

    from segue.program.executor import ProgramExecutor
    from segue.sampling_params import SamplingParams

    async def run() -> _HoldingEngine:
        engine = _HoldingEngine()
        ex = ProgramExecutor(engine, share_prefix=False)
        program = ex.create_program(None)
        params = SamplingParams(max_tokens=4)
        maps = _submit_maps(ex, program.id, params)
        for _ in range(50):
            await asyncio.sleep(0)
        assert engine.sent == {m.id: True for m in maps}  # nothing asks for them yet: latency by default
        reduce = _submit_reduce(ex, program.id, maps, params)
        assert sorted(engine.updates) == sorted((m.id, False) for m in maps)
        engine.release.set()
        await asyncio.wait_for(reduce.task, 5)
        assert engine.sent[reduce.id] is True
        return engine

    asyncio.run(run())


def test_map_calls_reach_the_engine_with_their_task_group() -> None:
    """Maps whose reduce is known when they launch carry its task group to the engine, which a pool
    uses to place them side by side (cluster/affinity_router.py); the reduce itself has none."""
    import asyncio

    from segue.program.executor import ProgramExecutor
    from segue.sampling_params import SamplingParams

    async def run() -> None:
        engine = _HoldingEngine()
        ex = ProgramExecutor(engine, share_prefix=False)
        program = ex.create_program(None)
        params = SamplingParams(max_tokens=4)
        maps = _submit_maps(ex, program.id, params)
        # Submitted before any map runs: the graph already shows the maps feed one consumer.
        reduce = _submit_reduce(ex, program.id, maps, params)
        for _ in range(50):
            await asyncio.sleep(0)
        assert engine.groups == {m.id: reduce.id for m in maps}
        engine.release.set()
        await asyncio.wait_for(reduce.task, 5)
        assert engine.groups[reduce.id] is None

    asyncio.run(run())
