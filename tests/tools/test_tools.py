"""The tool layer (segue.tools): specs, registry and config, builtins, parser, runner and stats.

Async code runs through asyncio.run inside plain tests (no pytest-asyncio needed). Timeouts are
kept to fractions of a second so the whole file stays fast on a shared two-core machine.
"""
from __future__ import annotations

import asyncio
import http.server
import importlib
import json
import random
import sys
import threading
import time

import pytest

from segue.tools import (
    BUILTINS,
    CalculatorError,
    DurationStats,
    ToolCall,
    ToolCallFormat,
    ToolCallParser,
    ToolKind,
    ToolRegistry,
    ToolRunner,
    ToolSpec,
    ToolSpecError,
    evaluate,
    truncate,
)

# ---- tools referenced by config targets ("test_tools:...") -------------------------------------
ECHO_PARAMS = {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}
NOT_CALLABLE = 42
RELEASE = threading.Event()  # lets the sync hanging tool's thread finish when a test is done


def echo_tool(text: str) -> str:
    return f"echo: {text}"


async def async_echo(text: str) -> str:
    await asyncio.sleep(0)
    return text.upper()


def boom(text: str) -> str:
    raise ZeroDivisionError(f"cannot handle {text}")


def raises_own_timeout(text: str) -> str:
    raise TimeoutError("upstream socket timed out")


async def hang_async(text: str) -> str:
    await asyncio.sleep(60)
    return "never"


def hang_sync(text: str) -> str:
    RELEASE.wait(20)
    return "released"


def huge(text: str) -> str:
    return "x" * 1_000_000


def structured(text: str) -> dict:
    return {"text": text, "n": 3}


def spec(name: str, **kw) -> ToolSpec:
    return ToolSpec(name=name, description=f"{name} tool", parameters=ECHO_PARAMS, **kw)


def call(name: str, **arguments) -> ToolCall:
    return ToolCall(name=name, arguments=arguments)


def runner_with(*tools: tuple[ToolSpec, object]) -> ToolRunner:
    registry = ToolRegistry()
    for s, fn in tools:
        registry.register(s, fn)
    return ToolRunner(registry)


# ---- spec ------------------------------------------------------------------------------------
def test_spec_to_openai_and_ids():
    s = spec("echo", target="test_tools:echo_tool")
    assert s.to_openai() == {"type": "function", "function": {
        "name": "echo", "description": "echo tool", "parameters": ECHO_PARAMS}}
    c = ToolCall(name="echo", arguments={"text": "hi"})
    assert c.id.startswith("call_") and len(c.id) == 29 and c.id != ToolCall(name="echo").id
    assert json.loads(c.to_openai()["function"]["arguments"]) == {"text": "hi"}


@pytest.mark.parametrize("kwargs, message", [
    (dict(name="bad name"), "1-64 characters"),
    (dict(name="x" * 65), "1-64 characters"),
    (dict(name="ok\n"), "1-64 characters"),
    (dict(parameters={"type": "objekt"}), "not a valid JSON schema"),
    (dict(parameters={"type": "object", "properties": {"a": {"type": 5}}}), "properties/a/type"),
    (dict(parameters={"type": "string"}), '"type": "object"'),
    (dict(parameters=[]), "must be a JSON schema object"),
    (dict(kind=ToolKind.HTTP, target="ftp://x"), "http:// or https://"),
    (dict(kind="shell"), "kind must be one of"),
    (dict(target="not a target"), "pkg.module:function"),
    (dict(timeout_s=0), "timeout_s"),
    (dict(max_concurrency=0), "max_concurrency"),
])
def test_spec_validation(kwargs, message):
    fields = dict(name="t", description="d", parameters=ECHO_PARAMS) | kwargs
    with pytest.raises(ToolSpecError, match=message.replace("(", r"\(")):
        ToolSpec(**fields)
    assert issubclass(ToolSpecError, ValueError)


# ---- calculator ------------------------------------------------------------------------------
@pytest.mark.parametrize("expr, expected", [
    ("2 + 3 * 4", "14"), ("(2 + 3) * 4", "20"), ("-3 // 2", "-2"), ("7 % 3", "1"), ("2 ** 10", "1024"),
    ("-2 ** 2", "-4"), ("1 / 4", "0.25"), ("sqrt(16)", "4"), ("log(8, 2)", "3"), ("exp(0)", "1"),
    ("abs(-2.5)", "2.5"), ("round(pi, 3)", "3.142"), ("min(3, 1, 2) + max(4, 5)", "6"),
    ("cos(0) + sin(0) + tan(0)", "1"), ("round(e, 2)", "2.72"), ("2 ** -1", "0.5"), ("--5", "5"),
    ("10 ** 50", "1" + "0" * 50),
])
def test_calculator_values(expr, expected):
    _, fn = BUILTINS["calculator"]({})
    assert fn(expr) == expected


@pytest.mark.parametrize("expr, message", [
    ("__import__('os')", "unknown function"), ("(1).real", "attribute access"), ("x + 1", "unknown name"),
    ("9 ** 99999", "too large"), ("(10 ** 1000) ** 1000", "too large"), ("2 ^ 3", "use \\*\\*"),
    ("'a' * 3", "only numbers"), ("True + 1", "only numbers"), ("1 / 0", "division by zero"),
    ("sqrt(-1)", "math domain"), ("1e308 * 10", "finite"), ("(-8) ** (1/3)", "real number"),
    ("[1, 2]", "not allowed"), ("1 < 2", "not allowed"), ("lambda: 1", "not allowed"),
    ("sqrt(x=4)", "positional"), ("max()", "argument"), ("math.sqrt(4)", "attribute|named"),
    ("1 +", "invalid syntax"), ("", "empty"), ("1+" * 600 + "1", "too long"), ("-" * 900 + "1", "deeply"),
    ("(" * 250 + "1" + ")" * 250, "nested|deeply"),
])
def test_calculator_rejects(expr, message):
    with pytest.raises(CalculatorError, match=message):
        evaluate(expr)


def test_huge_power_is_rejected_quickly():
    t0 = time.perf_counter()
    for expr in ("9 ** 9 ** 9", "(2 ** 9999) * (2 ** 9999) * (2 ** 9999)", "99 ** 9999"):
        with pytest.raises(CalculatorError):
            evaluate(expr)
    assert time.perf_counter() - t0 < 0.5


# ---- other builtins --------------------------------------------------------------------------
def test_wait_and_clamp():
    wait_spec, wait = BUILTINS["wait"]({"max_seconds": 0.05})
    assert wait_spec.timeout_s > 0.05
    assert asyncio.run(wait(0.01)) == "waited 0.01 s"
    t0 = time.perf_counter()
    assert asyncio.run(wait(100)) == "waited 0.05 s"
    assert time.perf_counter() - t0 < 1.0
    with pytest.raises(ToolSpecError, match="unknown option"):
        BUILTINS["wait"]({"max": 3})


def test_search_default_corpus():
    search_spec, search = BUILTINS["search"]({})
    top = search("What is the capital of Australia?", 1)
    assert top.startswith("[1] capitals.md:") and "Canberra" in top and "[2]" not in top
    assert "Jupiter" in search("largest planet gas giant").split("\n\n")[0]
    assert search("boiling point of water", k=2).count("\n\n") == 1
    assert search("qwertyuiop").startswith("no passages match")
    assert search_spec.parameters["properties"]["k"]["maximum"] == 10


# ---- registry --------------------------------------------------------------------------------
def test_test_module_is_importable_as_target():
    # Config targets below say "test_tools:..."; pytest puts tests/ on sys.path (rootdir conftest,
    # prepend import mode), so importing that name must give this very module, not a second copy.
    assert importlib.import_module("test_tools") is sys.modules[__name__]


def _write_corpus(tmp_path):
    corpus = tmp_path / "docs"
    corpus.mkdir()
    (corpus / "fruit.txt").write_text("Bananas are yellow and rich in potassium.\n\nApples can be red or green.\n")
    return corpus


def test_registry_from_json(tmp_path):
    _write_corpus(tmp_path)
    config = {"tools": [
        {"name": "echo", "description": "Echo text", "parameters": ECHO_PARAMS, "python": "test_tools:echo_tool",
         "timeout_s": 2, "expected_seconds": 0.5},
        {"name": "remote", "parameters": ECHO_PARAMS, "url": "http://127.0.0.1:9/x"},
        {"builtin": "calculator"},
        {"builtin": "search", "name": "fruit_search", "corpus_dir": "docs", "timeout_s": 3},
    ]}
    path = tmp_path / "tools.json"
    path.write_text(json.dumps(config))
    reg = ToolRegistry.from_config(path)
    assert reg.names() == ["echo", "remote", "calculator", "fruit_search"]
    echo = reg.get("echo")
    assert echo.kind is ToolKind.PYTHON and echo.timeout_s == 2 and echo.expected_seconds == 0.5
    assert reg.entry("echo").fn is echo_tool
    assert reg.get("remote").kind is ToolKind.HTTP and reg.entry("remote").fn is None
    assert reg.get("fruit_search").timeout_s == 3
    assert "Bananas" in reg.entry("fruit_search").fn("yellow potassium")  # corpus_dir relative to file
    assert [t["function"]["name"] for t in reg.openai_tools()] == reg.names()
    assert reg.get("nope") is None and "nope" not in reg


def test_registry_from_toml(tmp_path):
    path = tmp_path / "tools.toml"
    path.write_text('''
[[tools]]
name = "shout"
description = "Upper-case text"
python = "test_tools:async_echo"
expected_seconds = 0.01
[tools.parameters]
type = "object"
required = ["text"]
[tools.parameters.properties.text]
type = "string"

[[tools]]
builtin = "wait"
max_seconds = 1.5
''')
    reg = ToolRegistry.from_config(path)
    assert reg.names() == ["shout", "wait"]
    assert reg.get("shout").parameters["properties"]["text"] == {"type": "string"}
    assert reg.get("wait").timeout_s == 6.5
    runner = ToolRunner(reg)
    assert runner.expected_seconds("shout") == 0.01  # the hint, before any observation
    result = asyncio.run(runner.run(call("shout", text="hey")))
    assert (result.content, result.is_error) == ("HEY", False)
    assert runner.expected_seconds("shout") == pytest.approx(result.duration_s)


@pytest.mark.parametrize("entry, message", [
    ({"name": "a", "parameters": ECHO_PARAMS}, "exactly one of"),
    ({"name": "a", "parameters": ECHO_PARAMS, "python": "test_tools:echo_tool", "url": "http://x"}, "exactly one"),
    ({"name": "a", "parameters": ECHO_PARAMS, "python": "no_such_module_xyz:f"}, "cannot import"),
    ({"name": "a", "parameters": ECHO_PARAMS, "python": "test_tools:missing"}, "no attribute"),
    ({"name": "a", "parameters": ECHO_PARAMS, "python": "test_tools:NOT_CALLABLE"}, "not callable"),
    ({"name": "a", "parameters": ECHO_PARAMS, "python": "test_tools:echo_tool", "timeout": 3}, "unknown key"),
    ({"name": "a", "python": "test_tools:echo_tool"}, "missing 'parameters'"),
    ({"builtin": "shell"}, "unknown builtin"),
    ({"builtin": "search", "corpus_dir": "/no/such/dir"}, "does not exist"),
    ({"builtin": "calculator", "timeout_s": -1}, "timeout_s"),
])
def test_registry_config_errors(entry, message):
    with pytest.raises(ToolSpecError, match=message):
        ToolRegistry.from_config({"tools": [entry]})


def test_registry_rejects_duplicates_and_bad_files(tmp_path):
    reg = ToolRegistry()
    reg.register(spec("echo"), echo_tool)
    with pytest.raises(ToolSpecError, match="already registered"):
        reg.register(spec("echo"), echo_tool)
    reg.register(spec("echo"), async_echo, replace=True)
    assert reg.entry("echo").fn is async_echo
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ToolSpecError, match="cannot parse"):
        ToolRegistry.from_config(bad)
    with pytest.raises(ToolSpecError, match='"tools" list'):
        ToolRegistry.from_config({"tool": []})


# ---- runner ----------------------------------------------------------------------------------
def test_runner_success_errors_and_recovery():
    runner = runner_with((spec("echo"), echo_tool), (spec("shout"), async_echo), (spec("boom"), boom),
                         (spec("own_timeout"), raises_own_timeout), (spec("structured"), structured))

    async def scenario():
        ok = await runner.run(call("echo", text="hi"))
        assert (ok.content, ok.is_error, ok.truncated, ok.name) == ("echo: hi", False, False, "echo")
        bad = await runner.run(call("boom", text="it"))
        assert bad.is_error and bad.content == "error: tool 'boom' failed: ZeroDivisionError: cannot handle it"
        assert "Traceback" not in bad.content
        own = await runner.run(call("own_timeout", text="x"))
        assert "failed: TimeoutError: upstream" in own.content  # the tool's, not the runner's timeout
        assert (await runner.run(call("shout", text="still works"))).content == "STILL WORKS"
        assert json.loads((await runner.run(call("structured", text="t"))).content) == {"text": "t", "n": 3}
        return ok, bad

    ok, bad = asyncio.run(scenario())
    assert ok.call_id.startswith("call_") and ok.to_message()["role"] == "tool"
    assert runner.stats.count("boom") == 1 and runner.stats.count("echo") == 1


def test_runner_rejects_bad_calls_without_running_or_importing():
    runner = runner_with((spec("echo"), echo_tool))

    async def scenario():
        unknown = await runner.run(call("os:system", text="rm"))
        assert unknown.is_error and "unknown tool 'os:system'" in unknown.content and "echo" in unknown.content
        missing = await runner.run(call("echo"))
        assert missing.is_error and "invalid arguments for tool 'echo'" in missing.content
        assert "'text' is a required property" in missing.content
        wrong_type = await runner.run(call("echo", text=5))
        assert "is not of type 'string'" in wrong_type.content and "(at text)" in wrong_type.content
        _, [broken] = ToolCallParser().find_calls('<tool_call>{"name": "echo", </tool_call>')
        parse = await runner.run(broken)
        assert parse.is_error and parse.content.startswith("error: could not parse the tool call")

    asyncio.run(scenario())
    assert runner.stats.names() == []  # nothing ran, nothing recorded


@pytest.mark.parametrize("hang", [hang_async, hang_sync])
def test_hanging_tool_times_out_without_stalling_others(hang):
    RELEASE.clear()
    runner = runner_with((spec("hang", timeout_s=0.3), hang), (spec("echo"), echo_tool))

    async def scenario():
        t0 = time.perf_counter()
        hung = asyncio.create_task(runner.run(call("hang", text="x")))
        await asyncio.sleep(0.02)
        fast = await runner.run(call("echo", text="quick"))
        fast_done = time.perf_counter() - t0
        return await hung, fast, fast_done, time.perf_counter() - t0

    try:
        hung, fast, fast_done, total = asyncio.run(scenario())
    finally:
        RELEASE.set()  # let the sync tool's abandoned thread end
    assert fast.content == "echo: quick" and fast_done < 0.25
    assert hung.is_error and hung.content == "error: tool 'hang' timed out after 0.3 s"
    assert 0.3 <= hung.duration_s < 0.8 and total < 0.9
    assert runner.stats.count("hang") == 1


def test_concurrency_limit():
    active = peak = 0

    async def slow(text: str) -> str:
        nonlocal active, peak
        active += 1
        peak = max(peak, active)
        await asyncio.sleep(0.02)
        active -= 1
        return text

    runner = runner_with((spec("slow", max_concurrency=2), slow))
    results = asyncio.run(runner.run_all([call("slow", text=str(i)) for i in range(6)]))
    assert [r.content for r in results] == [str(i) for i in range(6)] and peak == 2


def test_large_result_is_truncated():
    runner = runner_with((spec("huge", max_result_chars=1000), huge))
    result = asyncio.run(runner.run(call("huge", text="x")))
    assert result.truncated and not result.is_error and len(result.content) <= 1000
    dropped = 1_000_000 - result.content.index("…")
    assert result.content.endswith(f"…[truncated {dropped} chars]")
    assert truncate("short", 10) == ("short", False)


class _Handler(http.server.BaseHTTPRequestHandler):
    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        status, reply = (500, "database is down") if self.path == "/fail" else (200, f"got {body['text']}")
        self.send_response(status)
        self.send_header("Content-Type", "text/plain")
        self.end_headers()
        self.wfile.write(reply.encode())

    def log_message(self, *args):  # keep test output quiet
        pass


def test_http_tool():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        runner = runner_with((spec("ok", kind=ToolKind.HTTP, target=f"{base}/ok"), None),
                             (spec("fail", kind=ToolKind.HTTP, target=f"{base}/fail"), None))

        async def scenario():
            async with runner:
                return (await runner.run(call("ok", text="ping")), await runner.run(call("fail", text="x")))

        ok, fail = asyncio.run(scenario())
    finally:
        server.shutdown()
        server.server_close()
    assert (ok.content, ok.is_error) == ("got ping", False)
    assert fail.is_error and fail.content == "error: tool 'fail' returned HTTP 500: database is down"
    # Nothing listens there any more: a transport error is an error result too.
    runner = runner_with((spec("gone", kind=ToolKind.HTTP, target=f"{base}/ok", timeout_s=2), None))

    async def gone_scenario():
        async with runner:
            return await runner.run(call("gone", text="x"))

    gone = asyncio.run(gone_scenario())
    assert gone.is_error and "failed: ConnectError" in gone.content


# ---- parser ----------------------------------------------------------------------------------
def test_parser_calls_and_content():
    p = ToolCallParser()
    text = ('Let me check.\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "{1} + \\"}\\""}}\n'
            '</tool_call>\n<tool_call>{"name": "search", "arguments": "{\\"query\\": \\"Mars\\"}"}</tool_call>')
    content, calls = p.find_calls(text)
    assert content == "Let me check."
    assert [(c.name, c.arguments, c.error) for c in calls] == [
        ("calculator", {"expression": '{1} + "}"'}, None), ("search", {"query": "Mars"}, None)]
    assert calls[0].raw.startswith("<tool_call>") and calls[0].raw.endswith("</tool_call>")
    assert p.find_calls("no calls here") == ("no calls here", [])
    assert p.stop_strings == ["</tool_call>"]
    [batched] = [p.find_calls('<tool_call>[{"name": "a"}, {"name": "b", "arguments": null}]</tool_call>')]
    assert [(c.name, c.arguments) for c in batched[1]] == [("a", {}), ("b", {})]


@pytest.mark.parametrize("payload, name, error", [
    ('{"name": "x", "arguments": {', "", "not valid JSON"),
    ('["x"]', "", "JSON object"),
    ('{"arguments": {}}', "", '"name"'),
    ('{"name": "x", "arguments": "{bad"}', "x", "arguments string"),
    ('{"name": "x", "arguments": [1]}', "x", "must be a JSON object"),
])
def test_parser_malformed(payload, name, error):
    _, [c] = ToolCallParser().find_calls(f"before <tool_call>{payload}</tool_call> after")
    assert c.name == name and error in c.error


def test_parser_streaming_token_by_token():
    p = ToolCallParser()
    text = 'Sure <tool_call>{"name": "a", "arguments": {"s": "<tool"}}</tool_call> done <tool_c'
    assert not p.has_complete_call(text[:text.index("</tool_call>") + 11])
    assert p.has_complete_call(text[:text.index("</tool_call>") + 12])
    assert not p.has_complete_call(text, pos=text.index(" done"))
    assert p.safe_prefix_len("Sure <tool") == 5 and p.safe_prefix_len("a < b") == 5
    assert p.safe_prefix_len('x <tool_call>{"name"') == 2
    assert p.safe_prefix_len(text) == len(text) - len("<tool_c")
    # Stream with random token boundaries: boundaries never split a call, and content plus calls
    # reassembled from the deltas equal parsing the whole text at once.
    rng = random.Random(0)
    for _ in range(20):
        sent, pieces, calls = 0, [], []
        cuts = sorted(rng.sample(range(1, len(text)), 12)) + [len(text)]
        for cut in cuts:
            safe = p.safe_prefix_len(text[:cut])
            assert safe >= sent
            piece, new_calls = p.find_calls(text[sent:safe], strip=False)
            assert all(c.error is None for c in new_calls) and p.content(text[sent:safe]) == piece
            pieces.append(piece)
            calls += new_calls
            sent = safe
        assert "".join(pieces) == "Sure  done " and [c.arguments for c in calls] == [{"s": "<tool"}]
    content, [unfinished] = p.find_calls('ok <tool_call>{"name": "a"')
    assert content == "ok" and "unterminated" in unfinished.error


def test_custom_markers():
    p = ToolCallParser.for_format(ToolCallFormat(start="[TOOL]", end="[/TOOL]"))
    content, [c] = p.find_calls('hi [TOOL]{"name": "t", "parameters": {"a": 1}}[/TOOL]')
    assert (content, c.name, c.arguments) == ("hi", "t", {"a": 1}) and p.stop_strings == ["[/TOOL]"]


# ---- stats -----------------------------------------------------------------------------------
def test_duration_stats():
    np = pytest.importorskip("numpy")
    stats = DurationStats(window=100)
    assert stats.quantile("t", 0.5) is None and stats.expected("t", default=2.0) == 2.0
    stats.set_hint("t", 1.5)
    assert stats.expected("t") == 1.5
    rng = random.Random(1)
    values = [rng.expovariate(2.0) for _ in range(250)]
    for v in values:
        stats.observe("t", v)
    recent = values[-100:]
    assert stats.count("t") == 250 and stats.expected("t") == pytest.approx(np.mean(recent))
    for q in (0.0, 0.1, 0.5, 0.9, 0.99, 1.0):
        assert stats.quantile("t", q) == pytest.approx(np.quantile(recent, q))
    summary = stats.summary("t")
    assert summary.p90 == pytest.approx(np.quantile(recent, 0.9)) and summary.max == max(recent)
    assert set(stats.snapshot()) == {"t"}
    with pytest.raises(ValueError):
        stats.observe("t", -1.0)
    with pytest.raises(ValueError):
        stats.quantile("t", 1.5)


def test_duration_stats_threads():
    stats = DurationStats(window=50)

    def writer(k: int):
        for i in range(2000):
            stats.observe(f"tool{k % 2}", float(i % 7))

    threads = [threading.Thread(target=writer, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads):
        q = stats.quantile("tool0", 0.5)
        assert q is None or 0.0 <= q <= 6.0
    for t in threads:
        t.join()
    assert stats.count("tool0") == stats.count("tool1") == 4000
