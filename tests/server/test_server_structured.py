"""Constrained output end to end through the HTTP API (official openai client, a tiny random Llama on
CPU). A random model is the harshest client of the grammar: whatever it would write, the answers
must validate. Schemas use bounded fields so answers finish well within max_tokens."""
from __future__ import annotations

import json
import re
from typing import Any, Iterator, Literal, Optional

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from engine_helpers import OpensCalls
from segue.engine.async_engine import AsyncLLMEngine
from segue.server.app import create_app
from server_helpers import ServerThread, encode, make_async_engine, on_engine, shutdown, wait_idle

LIGHT = {"type": "object", "properties": {"on": {"type": "boolean"},
                                          "level": {"type": "integer", "minimum": 0, "maximum": 9},
                                          "room": {"enum": ["kitchen", "hall"]}},
         "required": ["on", "level", "room"]}
TOOLS = [{"type": "function", "function": {"name": "set_light", "parameters": LIGHT}},
         {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}]
SAMPLED = {"temperature": 1.0, "max_tokens": 64}


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[AsyncLLMEngine]:
    eng = make_async_engine(tmp_path_factory.mktemp("server-structured"))
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
    # A random model never opens a call by itself: make every answer start with the marker, so the
    # rest of each call (name, arguments, end) is what the "auto" grammar lets the model write.
    opener = on_engine(engine, lambda e: OpensCalls(e, encode("<tool_call>")))
    try:
        for seed in range(4):
            r = chat(client, seed=seed, tools=TOOLS, tool_choice="auto", max_tokens=48)
            message = r.choices[0].message
            assert "<tool_call>" not in (message.content or "")
            assert r.choices[0].finish_reason == "tool_calls" and len(message.tool_calls or []) == 1
            for tc in message.tool_calls:
                assert tc.function.name in ("set_light", "get_time")
                schema = LIGHT if tc.function.name == "set_light" else TOOLS[1]["function"]["parameters"]
                jsonschema.validate(json.loads(tc.function.arguments), schema)
            client.delete(f"/sessions/{r.session_id}", cast_to=object)
    finally:
        on_engine(engine, lambda e: setattr(e.executor, "execute", opener.real))
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
    {"response_format": response_format({"type": "object", "properties": {"a": {"type": "strnig"}}})},
    {"extra_body": {"guided_json": {"type": 3}}},
    {"extra_body": {"guided_choice": ["a", "b"]}, "tools": TOOLS},
    {"response_format": {"type": "xml"}},
    {"response_format": {"type": "json_schema"}},
    {"extra_body": {"guided_regex": "(unclosed"}},
    {"extra_body": {"guided_choice": []}},
])
def test_unsupported_constraints_are_400(client: openai.OpenAI, kwargs: dict) -> None:
    with pytest.raises(openai.BadRequestError):
        chat(client, **kwargs)


# ---- schemas agent frameworks send, and an answer format beside tools ----------------------------
class Address(BaseModel):
    city: str = Field(max_length=12)
    zip: Optional[str] = Field(default=None, pattern=r"^[0-9]{5}$")


class Order(BaseModel):
    colors: set[Literal["red", "green", "blue"]]  # uniqueItems
    size: Literal["S", "M", "L"]
    qty: int = Field(ge=1, le=9)
    note: Optional[str] = Field(default=None, max_length=8)
    address: Address


NOT_ZERO = {"type": "object", "properties": {"v": {"type": "integer", "minimum": -5, "maximum": 5,
                                                   "not": {"const": 0}}}, "required": ["v"]}
AGENT_TOOLS = [{"type": "function", "function": {"name": "order", "parameters": Order.model_json_schema()}},
               {"type": "function", "function": {"name": "pick", "parameters": NOT_ZERO}}]


def answer_of(r: Any, stream: bool) -> tuple[str, list[tuple[str, str]], str | None]:
    """(content, [(tool name, arguments)], session id) of a response or a list of chunks."""
    if not stream:
        m = r.choices[0].message
        return (m.content or "", [(c.function.name, c.function.arguments) for c in m.tool_calls or []],
                (r.model_extra or {}).get("session_id"))
    deltas = [c.choices[0].delta for c in r if c.choices]
    calls = [(tc.function.name, tc.function.arguments) for d in deltas for tc in d.tool_calls or []]
    session = next(((c.model_extra or {}).get("session_id") for c in r if (c.model_extra or {}).get("session_id")),
                   None)
    return "".join(d.content or "" for d in deltas), calls, session


def check_calls(calls: list[tuple[str, str]], tools: list[dict]) -> None:
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    for name, arguments in calls:
        jsonschema.validate(json.loads(arguments), schemas[name])


@pytest.mark.parametrize("stream", [False, True], ids=["blocking", "streaming"])
@pytest.mark.parametrize("choice", ["auto", "required"])
def test_pydantic_tool_schemas_are_accepted(client: openai.OpenAI, engine: AsyncLLMEngine, choice: str,
                                            stream: bool) -> None:
    # set, Literal, Optional, nested models, Field constraints and `not`: a 200 whatever the model
    # writes, and whatever reaches the client validates against the full schema.
    made_calls = 0
    for seed in range(3):
        r = chat(client, seed=seed, tools=AGENT_TOOLS, tool_choice=choice, max_tokens=96, stream=stream)
        content, calls, session = answer_of(list(r) if stream else r, stream)
        check_calls(calls, AGENT_TOOLS)
        made_calls += len(calls)
        if session:
            client.delete(f"/sessions/{session}", cast_to=object)
    if choice == "required":
        assert made_calls > 0
    wait_idle(engine)


@pytest.mark.parametrize("stream", [False, True], ids=["blocking", "streaming"])
@pytest.mark.parametrize("choice", ["auto", "required"])
def test_response_format_beside_tools_is_a_call_or_the_format(client: openai.OpenAI, engine: AsyncLLMEngine,
                                                              choice: str, stream: bool) -> None:
    for seed in range(3):
        r = chat(client, seed=seed, tools=TOOLS, tool_choice=choice, stream=stream,
                 response_format=response_format(LIGHT))
        content, calls, session = answer_of(list(r) if stream else r, stream)
        check_calls(calls, TOOLS)
        if choice == "required" or calls:
            assert len(calls) == 1 and not content
        else:
            jsonschema.validate(json.loads(content), LIGHT)
        if session:
            client.delete(f"/sessions/{session}", cast_to=object)
    wait_idle(engine)
