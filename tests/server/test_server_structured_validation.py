"""Structured output follows OpenAI's contract (server/structured_formats.py): `strict: true` with a
keyword the grammar cannot enforce (`not`, `if`/`then`, `uniqueItems` on anything but a small enum
set) is a 400 at request time naming the keyword; without `strict` the answer is best effort,
validated against the full schema after generation and returned marked (`schema_violation` on its
choice) when it breaks it; an answer cut by the client's own stop or max_tokens is left alone.
Nothing here is a 5xx.

The schemas below pair such a keyword with one the grammar does enforce so that every answer the
grammar allows breaks the unenforced one (or none does): the outcome does not depend on what the
random tiny model samples. Clients keep the OpenAI SDK's retries on (it retries a 5xx twice), and
count what reaches the server.
"""
from __future__ import annotations

import json
import logging
from typing import Any, Iterator

import httpx
import openai
import pytest

from segue.engine.async_engine import AsyncLLMEngine
from segue.server.app import create_app
from segue.server.structured_formats import answer_problem, schema_violation
from segue.structured import StructuredSpec
from segue.structured.enforceable import unenforced_keywords
from server_helpers import ServerThread, make_async_engine, on_engine, shutdown, wait_idle

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


class Counted(openai.OpenAI):
    """An OpenAI client with its retries on (the SDK's default, 2) that counts the HTTP requests it sends."""
    sent: list[str]


def client_of(server: ServerThread) -> Counted:
    sent: list[str] = []
    http = httpx.Client(timeout=120, event_hooks={"request": [lambda req: sent.append(req.url.path)]})
    client = Counted(base_url=server.url + "/v1", api_key="unused", http_client=http)
    assert client.max_retries == 2
    client.sent = sent
    return client


@pytest.fixture(scope="module")
def client(server: ServerThread) -> Counted:
    return client_of(server)


def response_format(schema: Any, strict: bool | None = None) -> dict:
    body = {"name": "answer", "schema": schema}
    return {"type": "json_schema", "json_schema": body if strict is None else {**body, "strict": strict}}


def chat(client: openai.OpenAI, **kwargs: Any) -> Any:
    return client.chat.completions.create(model="", messages=[{"role": "user", "content": "What color? Say red."}],
                                          extra_body={"model": None, **kwargs.pop("extra_body", {})},
                                          **{**SAMPLED, **kwargs})


def violation(choice: Any) -> str | None:
    """The choice's schema_violation (a Segue field the SDK keeps as an extra attribute)."""
    return (choice.model_extra or {}).get("schema_violation")


def sends_once(client: Counted, call: Any) -> Any:
    before = len(client.sent)
    result = call()
    assert len(client.sent) - before == 1, "the SDK retried: the server answered a 5xx"
    return result


# ---- strict: refused at request time ------------------------------------------------------
@pytest.mark.parametrize(("schema", "keyword"), [(NOT_RED, "not"), (IF_THEN, "if"), (UNIQUE, "uniqueItems")],
                         ids=["not", "if-then", "uniqueItems"])
def test_strict_schema_with_an_unenforceable_keyword_is_a_400_naming_it(client: Counted, engine: AsyncLLMEngine,
                                                                        schema: dict, keyword: str) -> None:
    steps = on_engine(engine, lambda e: e.num_steps)
    with pytest.raises(openai.BadRequestError) as e:
        sends_once(client, lambda: chat(client, response_format=response_format(schema, strict=True)))
    body = e.value.body if isinstance(e.value.body, dict) else {}
    error = body.get("error", body)
    assert error["code"] == "unsupported_schema_keyword" and error["param"] == "response_format.json_schema.schema"
    assert repr(keyword) in error["message"]
    # Refused before anything was generated.
    assert on_engine(engine, lambda e: e.num_steps) == steps


def test_strict_schema_the_grammar_enforces_is_served(client: Counted, engine: AsyncLLMEngine) -> None:
    # A set of a few enum values is spelled out (tool_grammar._enum_set): strict may have it.
    flags = {"type": "array", "items": {"enum": ["a", "b"]}, "uniqueItems": True}
    r = sends_once(client, lambda: chat(client, response_format=response_format(flags, strict=True)))
    assert r.choices[0].finish_reason in ("stop", "length")
    if r.choices[0].finish_reason == "stop":
        assert violation(r.choices[0]) is None
    wait_idle(engine)


def test_strict_must_be_a_boolean(client: Counted) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, response_format={"type": "json_schema", "json_schema": {"schema": NOT_GREEN, "strict": "yes"}})
    assert "strict" in e.value.message


# ---- without strict: best effort, marked ---------------------------------------------------
@pytest.mark.parametrize("schema", [NOT_RED, IF_THEN, UNIQUE], ids=["not", "if-then", "uniqueItems"])
def test_chat_answer_that_breaks_its_schema_comes_back_marked(client: Counted, engine: AsyncLLMEngine,
                                                              schema: dict, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="segue.server.structured_formats"):
        r = sends_once(client, lambda: chat(client, response_format=response_format(schema)))
    choice = r.choices[0]
    assert choice.finish_reason == "stop" and violation(choice)
    assert "schema_violation" in caplog.text
    # The answer as generated: valid JSON that the unenforced keyword rejects.
    json.loads(choice.message.content)
    wait_idle(engine)


def test_the_marker_says_where_the_answer_breaks_the_schema(server: ServerThread, engine: AsyncLLMEngine) -> None:
    r = httpx.post(server.url + "/v1/chat/completions", timeout=120, json={
        "messages": [{"role": "user", "content": "Say red."}], **SAMPLED,
        "response_format": response_format(NOT_RED, strict=False)})
    assert r.status_code == 200
    choice = r.json()["choices"][0]
    assert json.loads(choice["message"]["content"]) == {"color": "red"}
    assert "/color" in choice["schema_violation"]
    wait_idle(engine)


def test_every_choice_of_n_is_answered_and_marked_on_its_own(client: Counted, engine: AsyncLLMEngine) -> None:
    r = sends_once(client, lambda: chat(client, n=3, response_format=response_format(NOT_RED)))
    assert sorted(c.index for c in r.choices) == [0, 1, 2]
    for c in r.choices:
        assert c.finish_reason == "stop" and "/color" in (violation(c) or "")
    wait_idle(engine)


def test_streamed_answer_that_breaks_its_schema_is_marked_on_its_final_chunk(client: Counted,
                                                                             engine: AsyncLLMEngine) -> None:
    finals: dict[int, Any] = {}
    text: dict[int, str] = {}

    def run() -> None:
        for chunk in chat(client, stream=True, n=2, response_format=response_format(NOT_RED)):
            for c in chunk.choices:
                text[c.index] = text.get(c.index, "") + (c.delta.content or "")
                if c.finish_reason:
                    finals[c.index] = c
    sends_once(client, run)
    assert sorted(finals) == [0, 1]
    for i, c in finals.items():
        assert c.finish_reason == "stop" and "/color" in (violation(c) or "")
        assert json.loads(text[i]) == {"color": "red"}
    wait_idle(engine)


def test_answer_beside_tools_that_cannot_be_called_is_marked(client: Counted, engine: AsyncLLMEngine) -> None:
    tools = [{"type": "function", "function": {"name": "paint", "parameters": {"type": "object", "properties": {}}}}]
    r = sends_once(client, lambda: chat(client, tools=tools, tool_choice="none",
                                        response_format=response_format(NOT_RED)))
    assert r.choices[0].finish_reason == "stop" and violation(r.choices[0])
    wait_idle(engine)


def test_answer_the_full_schema_accepts_is_unmarked(client: Counted, engine: AsyncLLMEngine) -> None:
    r = chat(client, response_format=response_format(NOT_GREEN))
    assert r.choices[0].finish_reason == "stop" and violation(r.choices[0]) is None
    assert json.loads(r.choices[0].message.content)["color"] in ("red", "blue")
    stream = chat(client, stream=True, extra_body={"guided_json": NOT_GREEN})
    chunks = [c for chunk in stream for c in chunk.choices]
    assert chunks[-1].finish_reason == "stop" and violation(chunks[-1]) is None
    assert json.loads("".join(c.delta.content or "" for c in chunks))["color"] in ("red", "blue")
    wait_idle(engine)


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_an_answer_cut_by_the_clients_own_stop_or_max_tokens_is_not_an_error(client: Counted, engine: AsyncLLMEngine,
                                                                             stream: bool) -> None:
    # The grammar writes '{"color": "red"}'; the client's stop string cuts it inside the JSON.
    for cut in ({"stop": ["red"]}, {"max_tokens": 3}):
        def run(cut: dict = cut) -> tuple[str, str | None, str | None]:
            if not stream:
                r = chat(client, response_format=response_format(NOT_RED), **cut)
                return r.choices[0].message.content or "", r.choices[0].finish_reason, violation(r.choices[0])
            text, finish, marked = "", None, None
            for chunk in chat(client, stream=True, response_format=response_format(NOT_RED), **cut):
                for c in chunk.choices:
                    text += c.delta.content or ""
                    finish, marked = c.finish_reason or finish, violation(c) or marked
            return text, finish, marked
        text, finish, marked = sends_once(client, run)
        assert finish == ("stop" if "stop" in cut else "length") and marked is None
        assert text and '"red"' not in text  # cut short, inside the JSON
    wait_idle(engine)


def test_completions_mark_guided_json_and_response_format(client: Counted, engine: AsyncLLMEngine) -> None:
    def complete(**kwargs: Any) -> Any:
        extra = {"model": None, **kwargs.pop("extra_body", {})}
        return client.completions.create(model="", prompt="Color:", extra_body=extra, **{**SAMPLED, **kwargs})

    for extra in ({"guided_json": NOT_RED}, {"response_format": response_format(UNIQUE)}):
        r = sends_once(client, lambda extra=extra: complete(n=2, extra_body=extra))
        assert len(r.choices) == 2 and all(c.finish_reason == "stop" and violation(c) for c in r.choices)
        finals = sends_once(client, lambda extra=extra: [c for chunk in complete(stream=True, extra_body=extra)
                                                         for c in chunk.choices if c.finish_reason])
        assert len(finals) == 1 and finals[0].finish_reason == "stop" and violation(finals[0])
    with pytest.raises(openai.BadRequestError):
        complete(extra_body={"response_format": response_format(UNIQUE, strict=True)})
    r = complete(extra_body={"guided_json": NOT_GREEN})
    assert r.choices[0].finish_reason == "stop" and json.loads(r.choices[0].text)["color"] in ("red", "blue")
    assert violation(r.choices[0]) is None
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


def test_unenforced_keywords_come_from_the_grammar_library() -> None:
    assert unenforced_keywords(NOT_RED) == ["not"]
    assert unenforced_keywords(IF_THEN) == ["if", "then"]
    assert unenforced_keywords({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}) == ["uniqueItems"]
    # Spelled out by Segue's own compile: a set of a few enum values.
    assert unenforced_keywords({"type": "array", "items": {"enum": ["a", "b"]}, "uniqueItems": True}) == []
    assert unenforced_keywords({"type": "object", "properties": {"d": {"type": "string", "format": "date"}}}) == []
    assert unenforced_keywords(True) == []


def test_schema_violation_leaves_cut_answers_alone() -> None:
    spec = StructuredSpec.json_schema(NOT_RED)
    assert "/color" in (schema_violation(spec, '{"color": "red"}', "stop", None) or "")
    assert schema_violation(spec, '{"color": "re', "stop", "d\"}") is None     # the client's stop string
    assert schema_violation(spec, '{"color": "re', "stop", 42) is None         # the client's stop token id
    assert schema_violation(spec, '{"color": "re', "length", None) is None     # max_tokens
