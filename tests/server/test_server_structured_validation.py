"""Answers under response_format / guided_json are validated against the full schema after generation.

The grammar leaves out keywords llguidance does not enforce (`not`, `if`/`then`, `uniqueItems` on
anything but a small enum set). The schemas below pair such a keyword with one the grammar does
enforce so that every answer the grammar allows breaks the unenforced one (or none does): the
outcome does not depend on what the random tiny model samples. An invalid answer must never come
back as a plain success: a 500 with an OpenAI-style error, or an error event in a stream.
"""
from __future__ import annotations

import json
from typing import Any, Iterator

import httpx
import openai
import pytest

from segue.engine.async_engine import AsyncLLMEngine
from segue.server.app import create_app
from segue.server.config import ServerConfig
from segue.server.structured_formats import answer_problem
from segue.structured import StructuredSpec
from server_helpers import ServerThread, make_async_engine, num_paused, shutdown, wait_idle

# The issue's example, made deterministic: the grammar can only write "red", which `not` forbids.
NOT_RED = {"type": "object", "properties": {"color": {"type": "string", "enum": ["red"], "not": {"enum": ["red"]}}},
           "required": ["color"]}
# `not` that no answer the grammar allows can break: a 200 as before.
NOT_GREEN = {"type": "object", "properties": {"color": {"enum": ["red", "blue"], "not": {"const": "green"}}},
             "required": ["color"]}
IF_THEN = {"type": "object", "properties": {"a": {"const": 1}, "b": {"const": 2}}, "required": ["a", "b"],
           "if": {"properties": {"a": {"const": 1}}}, "then": {"properties": {"b": {"const": 3}}}}
UNIQUE = {"type": "array", "items": {"const": 1}, "minItems": 2, "maxItems": 2, "uniqueItems": True}
SAMPLED = {"temperature": 1.0, "max_tokens": 48, "seed": 1}


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[AsyncLLMEngine]:
    eng = make_async_engine(tmp_path_factory.mktemp("server-structured-validation"))
    yield eng
    shutdown(eng)


@pytest.fixture(scope="module")
def server(engine: AsyncLLMEngine) -> Iterator[ServerThread]:
    with ServerThread(create_app(engine)) as s:
        yield s


def client_of(server: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def client(server: ServerThread) -> openai.OpenAI:
    return client_of(server)


@pytest.fixture(scope="module")
def auto_client(engine: AsyncLLMEngine) -> Iterator[openai.OpenAI]:
    # Auto-continuation holds a plain turn at its end: an invalid one must not be held.
    with ServerThread(create_app(engine, config=ServerConfig(auto_continue=True))) as s:
        yield client_of(s)


def response_format(schema: Any) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}


def chat(client: openai.OpenAI, **kwargs: Any) -> Any:
    return client.chat.completions.create(model="", messages=[{"role": "user", "content": "What color? Say red."}],
                                          extra_body={"model": None, **kwargs.pop("extra_body", {})},
                                          **{**SAMPLED, **kwargs})


def assert_schema_error(err: openai.APIError) -> None:
    body = err.body if isinstance(err.body, dict) else {}
    body = body.get("error", body)
    assert body.get("code") == "structured_output_invalid", body
    assert "schema" in err.message


@pytest.mark.parametrize("schema", [NOT_RED, IF_THEN, UNIQUE], ids=["not", "if-then", "uniqueItems"])
def test_chat_answer_that_breaks_its_schema_is_an_error(auto_client: openai.OpenAI, engine: AsyncLLMEngine,
                                                        schema: dict) -> None:
    with pytest.raises(openai.InternalServerError) as e:
        chat(auto_client, response_format=response_format(schema))
    assert e.value.status_code == 500
    assert_schema_error(e.value)
    # Aborted, not held for a continuation the client will never send.
    wait_idle(engine)
    assert num_paused(engine) == 0


def test_error_says_where_the_answer_breaks_the_schema(server: ServerThread, engine: AsyncLLMEngine) -> None:
    r = httpx.post(server.url + "/v1/chat/completions", timeout=120, json={
        "messages": [{"role": "user", "content": "Say red."}], **SAMPLED, "response_format": response_format(NOT_RED)})
    assert r.status_code == 500
    error = r.json()["error"]
    assert error["type"] == "server_error" and error["code"] == "structured_output_invalid"
    assert error["param"] == "response_format"
    assert "/color" in error["message"] and "red" in error["message"]
    wait_idle(engine)


def test_streamed_chat_answer_that_breaks_its_schema_ends_in_an_error(client: openai.OpenAI,
                                                                      engine: AsyncLLMEngine) -> None:
    finishes: list[Any] = []
    with pytest.raises(openai.APIError) as e:
        for chunk in chat(client, stream=True, response_format=response_format(NOT_RED)):
            finishes += [c.finish_reason for c in chunk.choices if c.finish_reason]
    assert finishes == []  # no chunk claimed the answer was complete
    assert_schema_error(e.value)
    wait_idle(engine)


def test_answer_beside_tools_that_cannot_be_called_is_validated(client: openai.OpenAI,
                                                                engine: AsyncLLMEngine) -> None:
    tools = [{"type": "function", "function": {"name": "paint", "parameters": {"type": "object", "properties": {}}}}]
    with pytest.raises(openai.InternalServerError) as e:
        chat(client, tools=tools, tool_choice="none", response_format=response_format(NOT_RED))
    assert_schema_error(e.value)
    wait_idle(engine)


def test_answer_the_full_schema_accepts_is_a_success(client: openai.OpenAI, engine: AsyncLLMEngine) -> None:
    r = chat(client, response_format=response_format(NOT_GREEN))
    assert r.choices[0].finish_reason == "stop"
    assert json.loads(r.choices[0].message.content)["color"] in ("red", "blue")
    stream = chat(client, stream=True, extra_body={"guided_json": NOT_GREEN})
    chunks = [c for chunk in stream for c in chunk.choices]
    assert chunks[-1].finish_reason == "stop"
    assert json.loads("".join(c.delta.content or "" for c in chunks))["color"] in ("red", "blue")
    wait_idle(engine)


def test_completions_validate_guided_json_and_response_format(client: openai.OpenAI, engine: AsyncLLMEngine) -> None:
    def complete(**kwargs: Any) -> Any:
        extra = {"model": None, **kwargs.pop("extra_body", {})}
        return client.completions.create(model="", prompt="Color:", extra_body=extra, **{**SAMPLED, **kwargs})

    for extra in ({"guided_json": NOT_RED}, {"response_format": response_format(UNIQUE)}):
        with pytest.raises(openai.InternalServerError) as e:
            complete(extra_body=extra)
        assert_schema_error(e.value)
        finishes: list[Any] = []
        with pytest.raises(openai.APIError) as e:
            for chunk in complete(stream=True, extra_body=extra):
                finishes += [c.finish_reason for c in chunk.choices if c.finish_reason]
        assert finishes == []
        assert_schema_error(e.value)
    r = complete(extra_body={"guided_json": NOT_GREEN})
    assert r.choices[0].finish_reason == "stop" and json.loads(r.choices[0].text)["color"] in ("red", "blue")
    wait_idle(engine)


def test_answer_problem() -> None:
    spec = StructuredSpec.json_schema(NOT_GREEN)
    assert answer_problem(spec, '{"color": "blue"}') is None
    assert "/color" in (answer_problem(spec, '{"color": "green"}') or "")
    # Cut by a stop string: not JSON at all.
    assert "not valid JSON" in (answer_problem(spec, '{"color": "re') or "")
    # Formats are part of the schema: a date's day must exist in its month.
    date = StructuredSpec.json_schema({"type": "string", "format": "date"})
    assert answer_problem(date, '"2024-02-29"') is None
    assert answer_problem(date, '"2023-02-29"') is not None
    # Regexes and choices are enforced by the grammar alone.
    assert answer_problem(StructuredSpec.regex("[a-z]+"), "123") is None
    assert answer_problem(None, "anything") is None
