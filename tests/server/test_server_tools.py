"""Server-side tools end to end: the official openai client against a live server whose tiny model is
scripted to call tools (see server_helpers). One client request, whatever happens inside."""
from __future__ import annotations

import threading
from typing import Any, Iterator

import openai
import pytest

from segue.engine.async_engine import AsyncLLMEngine
from segue.server.app import create_app
from segue.server.config import ServerConfig
from segue.tools.registry import ToolRegistry
from segue.tools.spec import ToolSpec
from server_helpers import (
    ScriptedModel,
    ServerThread,
    call_text,
    num_paused,
    on_engine,
    wait_idle,
    wait_until,
)

WAIT_TIMEOUT_S = 2.0


def failing_tool(**_: Any) -> str:
    raise RuntimeError("boom")


def registry() -> ToolRegistry:
    tools = ToolRegistry.from_config({"tools": [{"builtin": "calculator"},
                                                {"builtin": "wait", "timeout_s": WAIT_TIMEOUT_S}]})
    tools.register(ToolSpec(name="fail", description="Always fails.",
                            parameters={"type": "object", "properties": {}}), failing_tool)
    return tools


@pytest.fixture(scope="module")
def scripted(setup: tuple[AsyncLLMEngine, ScriptedModel]) -> ScriptedModel:
    model = setup[1]
    model.script("[calc]", call_text("calculator", {"expression": "2+3"}), "The answer is 5.")
    model.script("[fail]", "Let me try. " + call_text("fail", {}), "Recovered.")
    model.script("[slow]", call_text("wait", {"seconds": 30}), "Done waiting.")
    model.script("[loop]", *[call_text("calculator", {"expression": "1"})] * 6)
    model.script("[named]", '<tool_call>{"name": "calculator", "arguments": {"expression": "6*7"}}</tool_call>', "42.")
    rounds = [call_text("calculator", {"expression": f"{i}+1"}) for i in range(3)]
    model.script("[rounds]", *rounds, "Done.")
    model.script("[rounds-json]", *rounds, '{"answer": 3}')
    return model


@pytest.fixture(scope="module")
def server(engine: AsyncLLMEngine) -> Iterator[ServerThread]:
    with ServerThread(create_app(engine, tools=registry())) as s:
        yield s


@pytest.fixture(scope="module")
def client(server: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def ask(client: openai.OpenAI, text: str, extra_body: dict | None = None, **kwargs: Any) -> Any:
    # model=None: the server's one model, whatever the tiny checkpoint is called.
    return client.chat.completions.create(model="", messages=[{"role": "user", "content": text}], max_tokens=120,
                                          temperature=0, extra_body={"model": None, **(extra_body or {})}, **kwargs)


def test_calculator_loop_is_one_response(client: openai.OpenAI, engine: AsyncLLMEngine,
                                         scripted: ScriptedModel) -> None:
    calls_before = on_engine(engine, lambda e: e.tool_stats.count("calculator"))
    r = ask(client, "[calc] What is 2+3?")
    choice = r.choices[0]
    assert choice.finish_reason == "stop" and choice.message.content == "The answer is 5."
    assert not choice.message.tool_calls and "session_id" not in (r.model_extra or {})
    # The model saw the tools (fallback system message: SmolLM2's template ignores tools=) and the result.
    seen = scripted.seen_with("[calc]")[-1][1].text()
    assert "<tools>" in seen and '"name": "calculator"' in seen
    assert "<|im_start|>tool\n5<|im_end|>\n<|im_start|>assistant\n" in seen
    generated = len(scripted.scripts["[calc]"][0]) + len(scripted.scripts["[calc]"][1]) + 1  # + EOS
    assert r.usage.completion_tokens == generated

    chunks = list(ask(client, "[calc] again", stream=True, stream_options={"include_usage": True}))
    with_choices = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].delta.content or "" for c in with_choices) == "The answer is 5."
    assert [c.choices[0].finish_reason for c in with_choices if c.choices[0].finish_reason] == ["stop"]
    assert not any(c.choices[0].delta.tool_calls for c in with_choices)
    assert chunks[-1].usage.completion_tokens == generated
    # The engine timed both interceptions itself (the server records nothing).
    assert on_engine(engine, lambda e: e.tool_stats.count("calculator")) == calls_before + 2
    wait_idle(engine)


def test_failing_and_hanging_tools_become_results(client: openai.OpenAI, engine: AsyncLLMEngine,
                                                  scripted: ScriptedModel) -> None:
    results: dict[str, Any] = {}
    slow = threading.Thread(target=lambda: results.update(slow=ask(client, "[slow] take your time")))
    slow.start()
    wait_until(lambda: num_paused(engine) == 1, what="the slow request to pause on its tool")
    # While the hanging tool holds its request, others run their own tool rounds and finish.
    failed = ask(client, "[fail] go")
    plain = ask(client, "hello", extra_body={"ignore_eos": True})
    assert slow.is_alive(), "the hanging tool should still be running"
    assert failed.choices[0].message.content == "Let me try. Recovered."
    assert plain.usage.completion_tokens == 120
    assert "error: tool 'fail' failed: RuntimeError: boom" in scripted.seen_with("[fail]")[-1][1].text()
    slow.join(30)
    assert results["slow"].choices[0].message.content == "Done waiting."
    assert f"error: tool 'wait' timed out after {WAIT_TIMEOUT_S:g} s" in scripted.seen_with("[slow]")[-1][1].text()
    wait_idle(engine)


def test_tool_rounds_are_capped(engine: AsyncLLMEngine, scripted: ScriptedModel) -> None:
    with ServerThread(create_app(engine, tools=registry(), config=ServerConfig(max_tool_rounds=2))) as s:
        capped = openai.OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0, timeout=60)
        r = ask(capped, "[loop] forever")
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 3 * len(scripted.scripts["[loop]"][0])
    wait_idle(engine)


def test_named_tool_choice_is_constrained(client: openai.OpenAI, engine: AsyncLLMEngine,
                                       scripted: ScriptedModel) -> None:
    r = ask(client, "[named] six times seven", tool_choice={"type": "function", "function": {"name": "calculator"}})
    assert r.choices[0].message.content == "42."
    assert "<|im_start|>tool\n42<|im_end|>" in scripted.seen_with("[named]")[-1][1].text()
    wait_idle(engine)


@pytest.mark.parametrize("tools", [
    [{"type": "function", "function": {"name": "f", "parameters": {"type": "objekt"}}}],
    [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}],
    [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "required": "x"}}}],
    [{"type": "function", "function": {"name": "bad name!"}}],
    [{"type": "function"}],
    [{"type": "function", "function": {"name": "f"}}, {"type": "function", "function": {"name": "f"}}],
    [{"type": "function", "function": {"name": "calculator"}}],  # an operator tool's name
])
def test_invalid_tools_are_400(client: openai.OpenAI, tools: list[dict]) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        ask(client, "hi", tools=tools)
    assert info.value.code == "invalid_tool_schema"


def test_invalid_tool_choice_is_400(client: openai.OpenAI, engine: AsyncLLMEngine) -> None:
    for choice in ("sometimes", {"type": "function", "function": {"name": "nope"}}, {"type": "function"}):
        with pytest.raises(openai.BadRequestError, match="tool_choice"):
            ask(client, "hi", tool_choice=choice)
    # "none" hides the tools: nothing intercepts, even a scripted call comes back as text.
    r = ask(client, "[calc] no tools", tool_choice="none")
    assert r.choices[0].finish_reason == "stop" and r.choices[0].message.content.startswith("<tool_call>")
    wait_idle(engine)


def test_disconnect_during_a_tool_run_aborts(client: openai.OpenAI, engine: AsyncLLMEngine,
                                            scripted: ScriptedModel) -> None:
    stream = ask(client, "[slow] then hang up", stream=True)
    next(iter(stream))
    wait_until(lambda: num_paused(engine) == 1, what="the request to reach its tool call")
    stream.close()
    wait_idle(engine, timeout=5)
    # Aborted while the tool ran: the request never resumed with the (timed-out) result.
    assert "timed out" not in scripted.seen_with("[slow]")[-1][1].text()


ANSWER = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"]}


@pytest.mark.parametrize("marker, answer", [("[rounds]", None), ("[rounds-json]", ANSWER)])
def test_every_server_side_round_keeps_its_constraint(client: openai.OpenAI, engine: AsyncLLMEngine,
                                                      scripted: ScriptedModel, marker: str,
                                                      answer: dict | None) -> None:
    # Three server-side tool rounds, then the answer: every segment samples under the tool grammar
    # (with response_format, the one that also offers the answer format), not only the first.
    grammars: dict[int, set[Any]] = {}

    def record(e: Any) -> Any:
        inner = e.executor.execute

        def execute(out: Any) -> Any:
            for seq in out.seqs:
                if seq.sample and scripted._marker(seq.request) == marker:
                    g = seq.request.grammar
                    grammars.setdefault(len(seq.request.interceptions), set()).add(g.spec if g else None)
            return inner(out)
        e.executor.execute = execute
        return inner
    inner = on_engine(engine, record)
    schema_format = {"type": "json_schema", "json_schema": {"name": "a", "schema": answer}}
    extra = {"response_format": schema_format} if answer else {}
    try:
        r = ask(client, f"{marker} count", **extra)
    finally:
        on_engine(engine, lambda e: setattr(e.executor, "execute", inner))
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].message.content == ('{"answer": 3}' if answer else "Done.")
    assert sorted(grammars) == [0, 1, 2, 3]
    specs = {spec for seen in grammars.values() for spec in seen}
    assert len(specs) == 1 and None not in specs and next(iter(specs)).sticky
    assert on_engine(engine, lambda e: e.tool_stats.count("calculator")) >= 3
    wait_idle(engine)
