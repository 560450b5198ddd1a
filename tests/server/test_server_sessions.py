"""Client-side tools and sessions end to end: the response ends with tool_calls and a session id, the
paused request stays in the engine, the next request resumes it without recomputing what is held,
and only the tenant that made a session can use or close it."""
from __future__ import annotations

import json
from typing import Any, Iterator

import httpx
import openai
import pytest

from segue.engine.async_engine import AsyncLLMEngine
from segue.program.registry import scoped_program_id
from segue.server.app import create_app
from segue.server.auth import tenant_id
from segue.server.config import ServerConfig
from segue.tools.registry import ToolRegistry
from server_helpers import (
    ScriptedModel,
    ServerThread,
    call_text,
    encode,
    engine_stats,
    num_paused,
    on_engine,
    wait_idle,
    wait_until,
)

KEY_A, KEY_B = "sk-tenant-a", "sk-tenant-b"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


@pytest.fixture(scope="module")
def scripted(setup: tuple[AsyncLLMEngine, ScriptedModel]) -> ScriptedModel:
    model = setup[1]
    model.script("[weather]", "Checking. " + call_text("get_weather", {"city": "Paris"}), "It is sunny in Paris.")
    both = '[{"name": "calculator", "arguments": {"expression": "1+1"}}, ' \
           '{"name": "get_weather", "arguments": {"city": "Oslo"}}]'
    model.script("[mixed]", f"<tool_call>{both}</tool_call>", "Two, and snow.")
    return model


@pytest.fixture(scope="module")
def server(engine: AsyncLLMEngine) -> Iterator[ServerThread]:
    tools = ToolRegistry.from_config({"tools": [{"builtin": "calculator"}]})
    with ServerThread(create_app(engine, api_keys=[KEY_A, KEY_B], tools=tools)) as s:
        yield s


def make_client(server: ServerThread, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0, timeout=60)


def chat(client: openai.OpenAI, messages: list[dict], session: str | None = None, **kwargs: Any) -> Any:
    extra = {"model": None, **({"session_id": session} if session else {}), **kwargs.pop("extra_body", {})}
    kwargs.setdefault("max_tokens", 80)
    return client.chat.completions.create(model="", messages=messages, tools=[WEATHER], temperature=0,
                                          extra_body=extra, **kwargs)


def close(server: ServerThread, session: str, key: str, how: str = "delete") -> int:
    headers = {"Authorization": f"Bearer {key}"}
    if how == "delete":
        return httpx.delete(f"{server.url}/v1/sessions/{session}", headers=headers).status_code
    return httpx.post(f"{server.url}/v1/sessions/{session}/close", headers=headers).status_code


def test_client_tool_pauses_then_session_resumes(server: ServerThread, engine: AsyncLLMEngine,
                                                 scripted: ScriptedModel) -> None:
    a, b = make_client(server, KEY_A), make_client(server, KEY_B)
    messages = [{"role": "user", "content": "[weather] How is Paris?"}]
    raw = a.chat.completions.with_raw_response.create(
        model="", messages=messages, tools=[WEATHER], max_tokens=80, temperature=0, extra_body={"model": None})
    first = raw.parse()
    session = raw.headers["x-segue-session-id"]
    assert first.model_extra["session_id"] == session
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Checking. "
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    # The request stays paused in the engine, holding its KV (preserve policy in these tests).
    rid, seen = scripted.seen_with("[weather]")[-1]
    assert num_paused(engine) == 1 and engine_stats(engine)[0] > 0
    held = first.usage.total_tokens

    history = messages + [choice.message.model_dump(exclude_none=True),
                          {"role": "tool", "tool_call_id": call.id, "content": "sunny, 24 C"}]
    with pytest.raises(openai.NotFoundError) as info:  # another tenant: as if it did not exist
        chat(b, history, session)
    assert info.value.code == "session_not_found"
    assert close(server, session, KEY_B) == 404 and num_paused(engine) == 1

    steps_before = len(seen.chunks)
    second = chat(a, history, session)
    assert second.choices[0].message.content == "It is sunny in Paris."
    assert second.choices[0].finish_reason == "stop" and second.model_extra["session_id"] == session
    # Nothing held was recomputed: the resumed request's first chunk starts at the held context's
    # last (sampled, not yet computed) token and carries the tool result.
    resumed = seen.chunks[steps_before:]
    assert resumed[0][0] == held - 1 and all(start >= held - 1 for start, _ in resumed)
    assert "sunny, 24 C" in scripted_text(resumed[0][1])
    assert second.usage.prompt_tokens_details.cached_tokens == held
    assert second.usage.completion_tokens == len(encode("It is sunny in Paris.")) + 1
    assert rid == scripted.seen_with("[weather]")[-1][0]  # the same engine request, continued
    # A normal turn end in a session pauses the request for the human's reply, which continues it.
    assert num_paused(engine) == 1
    held = second.usage.total_tokens
    steps_before = len(seen.chunks)
    history += [second.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "Thanks!"}]
    third = chat(a, history, session)
    assert third.choices[0].finish_reason == "stop" and third.usage.prompt_tokens_details.cached_tokens == held
    resumed = seen.chunks[steps_before:]
    assert resumed[0][0] == held - 1 and all(start >= held - 1 for start, _ in resumed)
    # The held end-of-turn token is not appended a second time.
    assert scripted_text(resumed[0][1]).startswith("<|im_end|>\n<|im_start|>user\nThanks!<|im_end|>")
    assert close(server, session, KEY_A) == 200
    wait_idle(engine)
    with pytest.raises(openai.NotFoundError):
        chat(a, history, session)


def scripted_text(tokens: list[int]) -> str:
    from conftest import default_tokenizer
    return default_tokenizer().decode(tokens)


def test_streamed_tool_calls_and_close_frees_kv(server: ServerThread, engine: AsyncLLMEngine,
                                                scripted: ScriptedModel) -> None:
    a = make_client(server, KEY_A)
    hints = {"priority": 5, "program_id": "prog-7", "expected_tool_seconds": 42.0}
    chunks = list(chat(a, [{"role": "user", "content": "[weather] stream it"}], stream=True, extra_body=hints))
    with_choices = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].delta.content or "" for c in with_choices) == "Checking. "
    deltas = [t for c in with_choices for t in (c.choices[0].delta.tool_calls or [])]
    assert [(d.index, d.function.name) for d in deltas] == [(0, "get_weather")] and deltas[0].id
    assert with_choices[-1].choices[0].finish_reason == "tool_calls"
    session = with_choices[-1].model_extra["session_id"]
    assert engine_stats(engine)[0] > 0
    # The extensions reached the engine: scheduling hints, and the client's duration estimate.
    paused = on_engine(engine, lambda e: [(r.priority, r.program_id, r.interception.expected_duration)
                                          for r in e.scheduler.state.paused.paused.values()])
    # program_id is scoped to the API key (another key naming "prog-7" is another program).
    assert paused == [(5, scoped_program_id(tenant_id(KEY_A.encode()), "prog-7"), 42.0)]
    assert close(server, session, KEY_A, how="post") == 200
    wait_idle(engine)  # closing aborted the paused request: zero blocks held


def test_edited_history_starts_fresh(server: ServerThread, engine: AsyncLLMEngine) -> None:
    a = make_client(server, KEY_A)
    first = chat(a, [{"role": "user", "content": "[weather] How is Paris?"}])
    session = first.model_extra["session_id"]
    call = first.choices[0].message.tool_calls[0]
    edited = [{"role": "user", "content": "[weather] How is Paris, really?"},
              first.choices[0].message.model_dump(exclude_none=True),
              {"role": "tool", "tool_call_id": call.id, "content": "rain"}]
    again = chat(a, edited, session)
    # A fresh request replays the script from its start: another call, still one paused request.
    assert again.choices[0].finish_reason == "tool_calls" and again.model_extra["session_id"] == session
    assert num_paused(engine) == 1
    assert close(server, session, KEY_A) == 200
    wait_idle(engine)


def test_mixed_server_and_client_calls(server: ServerThread, engine: AsyncLLMEngine,
                                       scripted: ScriptedModel) -> None:
    a = make_client(server, KEY_A)
    messages = [{"role": "user", "content": "[mixed] sum and weather"}]
    first = chat(a, messages)
    (call,) = first.choices[0].message.tool_calls  # the calculator ran on the server already
    assert call.function.name == "get_weather"
    history = messages + [first.choices[0].message.model_dump(exclude_none=True),
                          {"role": "tool", "tool_call_id": call.id, "content": "snow"}]
    second = chat(a, history, first.model_extra["session_id"])
    assert second.choices[0].message.content == "Two, and snow."
    text = scripted.seen_with("[mixed]")[-1][1].text()
    # The server's result first, then the client's, each in the template's tool-message form.
    assert "<|im_start|>tool\n2<|im_end|>\n<|im_start|>tool\nsnow<|im_end|>\n<|im_start|>assistant\n" in text
    close(server, first.model_extra["session_id"], KEY_A)
    wait_idle(engine)


def test_human_turns_and_unknown_sessions(server: ServerThread, engine: AsyncLLMEngine) -> None:
    a = make_client(server, KEY_A)
    messages = [{"role": "user", "content": "Tell me a long story about a fox and a lighthouse."}]
    first = chat(a, messages, extra_body={"open_session": True, "ignore_eos": True}, max_tokens=8)
    session = first.model_extra["session_id"]
    # Cut off by max_tokens: held when the random tokens re-encode to themselves, else finished and
    # served from the prefix cache; either way the shared history is not computed again.
    history = messages + [{"role": "assistant", "content": first.choices[0].message.content},
                          {"role": "user", "content": "Go on."}]
    second = chat(a, history, session, extra_body={"ignore_eos": True}, max_tokens=4)
    assert second.model_extra["session_id"] == session
    assert second.usage.prompt_tokens_details.cached_tokens >= 16
    assert close(server, session, KEY_A) == 200
    with pytest.raises(openai.NotFoundError):
        chat(a, history, "sess-does-not-exist")
    assert close(server, "sess-does-not-exist", KEY_A) == 404
    wait_idle(engine)


def test_idle_sessions_expire(engine: AsyncLLMEngine) -> None:
    with ServerThread(create_app(engine, config=ServerConfig(session_ttl_s=0.3))) as s:
        a = make_client(s, "none")
        first = chat(a, [{"role": "user", "content": "[weather] expire me"}])
        assert first.choices[0].finish_reason == "tool_calls"
        wait_until(lambda: engine_stats(engine) == (0, 0), 5, "the idle session to expire")
        with pytest.raises(openai.NotFoundError):
            chat(a, [{"role": "user", "content": "x"}], first.model_extra["session_id"])
    wait_idle(engine)


def test_shutdown_releases_held_sessions(engine: AsyncLLMEngine) -> None:
    with ServerThread(create_app(engine)) as s:
        first = chat(make_client(s, "none"), [{"role": "user", "content": "[weather] leave me paused"}])
        assert first.choices[0].finish_reason == "tool_calls" and engine_stats(engine)[0] > 0
    wait_idle(engine)


def test_n_choices_each_run_their_server_tool_rounds(server: ServerThread, engine: AsyncLLMEngine,
                                                     scripted: ScriptedModel) -> None:
    scripted.script("[calc-n]", call_text("calculator", {"expression": "1+1"}), "Two.")
    a = make_client(server, KEY_A)
    resp = a.chat.completions.create(model="", messages=[{"role": "user", "content": "[calc-n] add"}], n=2,
                                     temperature=0, max_tokens=60, extra_body={"model": None})
    assert [(c.index, c.message.content, c.finish_reason) for c in resp.choices] == \
        [(0, "Two.", "stop"), (1, "Two.", "stop")]
    assert "session_id" not in (resp.model_extra or {})
    seen = scripted.seen_with("[calc-n]")
    assert len(seen) == 2 and all("<|im_start|>tool\n2<|im_end|>" in s.text() for _, s in seen)
    wait_idle(engine)
