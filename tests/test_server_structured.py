"""Constrained output end to end through the HTTP API (official openai client, a tiny random Llama on
CPU). A random model is the harshest client of the grammar: whatever it would write, the answers
must validate. Schemas use bounded fields so answers finish well within max_tokens."""
from __future__ import annotations

import json
import re
from typing import Any, Iterator

import jsonschema
import openai
import pytest

from segue.async_engine import AsyncLLMEngine
from segue.server.app import create_app
from test_server_support import ServerThread, make_engine, shutdown, wait_idle

LIGHT = {"type": "object", "properties": {"on": {"type": "boolean"},
                                          "level": {"type": "integer", "minimum": 0, "maximum": 9},
                                          "room": {"enum": ["kitchen", "hall"]}},
         "required": ["on", "level", "room"]}
TOOLS = [{"type": "function", "function": {"name": "set_light", "parameters": LIGHT}},
         {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}]
SAMPLED = {"temperature": 1.0, "max_tokens": 64}


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[AsyncLLMEngine]:
    eng = make_engine(tmp_path_factory.mktemp("server-structured"))
    yield eng
    shutdown(eng)


@pytest.fixture(scope="module")
def client(engine: AsyncLLMEngine) -> Iterator[openai.OpenAI]:
    with ServerThread(create_app(engine)) as s:
        yield openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def chat(client: openai.OpenAI, **kwargs: Any) -> Any:
    return client.chat.completions.create(model="", messages=[{"role": "user", "content": "Lights please."}],
                                          extra_body={"model": None, **kwargs.pop("extra_body", {})},
                                          **{**SAMPLED, **kwargs})


def response_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "light", "schema": schema, "strict": True}}


def test_json_schema_answers_validate_for_every_choice(client: openai.OpenAI, engine: AsyncLLMEngine) -> None:
    r = chat(client, n=4, seed=11, response_format=response_format(LIGHT))
    for choice in r.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), LIGHT)
    # Properties come in the schema's order.
    assert list(json.loads(r.choices[0].message.content)) == ["on", "level", "room"]
    wait_idle(engine)


def test_streamed_json_schema_answer_validates(client: openai.OpenAI, engine: AsyncLLMEngine) -> None:
    stream = chat(client, seed=3, stream=True, response_format=response_format(LIGHT))
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    jsonschema.validate(json.loads(text), LIGHT)
    wait_idle(engine)


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "set_light"}}])
def test_forced_tool_calls_have_valid_arguments(client: openai.OpenAI, engine: AsyncLLMEngine, choice: Any) -> None:
    for seed in range(3):
        r = chat(client, seed=seed, tools=TOOLS, tool_choice=choice)
        c = r.choices[0]
        assert c.finish_reason == "tool_calls" and len(c.message.tool_calls) == 1
        call = c.message.tool_calls[0].function
        if isinstance(choice, dict):
            assert call.name == "set_light"
        schema = LIGHT if call.name == "set_light" else TOOLS[1]["function"]["parameters"]
        jsonschema.validate(json.loads(call.arguments), schema)
        # The client holds the paused request in a session; drop it.
        client.delete(f"/sessions/{r.session_id}", cast_to=object)
    wait_idle(engine)


def test_streamed_forced_call(client: openai.OpenAI, engine: AsyncLLMEngine) -> None:
    chunks = list(chat(client, seed=5, stream=True, tools=TOOLS, tool_choice="required"))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    calls = [tc for d in deltas for tc in (d.tool_calls or [])]
    assert len(calls) == 1 and calls[0].function.name in ("set_light", "get_time")
    assert isinstance(json.loads(calls[0].function.arguments), dict)
    assert "".join(d.content or "" for d in deltas) == ""
    session = next(c.model_extra["session_id"] for c in chunks if (c.model_extra or {}).get("session_id"))
    client.delete(f"/sessions/{session}", cast_to=object)
    wait_idle(engine)


def test_auto_never_returns_a_malformed_call(client: openai.OpenAI, engine: AsyncLLMEngine) -> None:
    for seed in range(4):
        r = chat(client, seed=seed, tools=TOOLS, tool_choice="auto", max_tokens=24)
        message = r.choices[0].message
        assert "<tool_call>" not in (message.content or "")
        for tc in message.tool_calls or []:
            assert tc.function.name in ("set_light", "get_time")
            json.loads(tc.function.arguments)
        session = (r.model_extra or {}).get("session_id")
        if session:
            client.delete(f"/sessions/{session}", cast_to=object)
    wait_idle(engine)


def test_completions_accept_response_format_and_guided_extras(client: openai.OpenAI, engine: AsyncLLMEngine) -> None:
    def complete(**extra: Any) -> str:
        r = client.completions.create(model="", prompt="Answer:", seed=1, extra_body={"model": None, **extra},
                                      **SAMPLED)
        return r.choices[0].text
    assert complete(guided_choice=["yes", "no"]) in ("yes", "no")
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", complete(guided_regex="[0-9]{3}-[a-z]{2}"))
    jsonschema.validate(json.loads(complete(guided_json=LIGHT)), LIGHT)
    jsonschema.validate(json.loads(complete(response_format=response_format(LIGHT))), LIGHT)
    wait_idle(engine)


@pytest.mark.parametrize("kwargs", [
    {"response_format": response_format({"type": "object", "if": {"required": ["a"]}, "then": {}})},
    {"response_format": {"type": "xml"}},
    {"response_format": {"type": "json_schema"}},
    {"extra_body": {"guided_regex": "(unclosed"}},
    {"extra_body": {"guided_choice": []}},
    {"response_format": {"type": "json_object"}, "tools": TOOLS},
])
def test_unsupported_constraints_are_400(client: openai.OpenAI, kwargs: dict) -> None:
    with pytest.raises(openai.BadRequestError):
        chat(client, **kwargs)
