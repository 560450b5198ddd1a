"""n > 1 choices end to end with the official openai client (a tiny random Llama on CPU), and the
request bodies the OpenAPI schema declares."""
from __future__ import annotations

from collections import defaultdict
from typing import Any, Iterator

import httpx
import openai
import pytest

from segue.engine.async_engine import AsyncLLMEngine
from segue.server.app import create_app
from server_helpers import ServerThread, make_async_engine, on_engine, shutdown, wait_idle

# Random weights at temperature 1 over a 49k vocabulary: distinct seeds give distinct texts.
SAMPLED = {"temperature": 1.0, "max_tokens": 6, "extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[AsyncLLMEngine]:
    eng = make_async_engine(tmp_path_factory.mktemp("server-n"))
    yield eng
    shutdown(eng)


@pytest.fixture(scope="module")
def server(engine: AsyncLLMEngine) -> Iterator[ServerThread]:
    with ServerThread(create_app(engine)) as s:
        yield s


@pytest.fixture(scope="module")
def client(server: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def prefix_hits(engine: AsyncLLMEngine) -> int:
    return on_engine(engine, lambda e: e.scheduler.state.prefix_hit_tokens)


def chat(client: openai.OpenAI, content: str, **kwargs: Any) -> Any:
    return client.chat.completions.create(model="", messages=[{"role": "user", "content": content}],
                                          extra_body={"model": None, **kwargs.pop("extra_body", {})}, **kwargs)


def test_chat_n_choices_seeded(client: openai.OpenAI, engine: AsyncLLMEngine) -> None:
    content = "Write three different openings for a story about a lighthouse keeper and a fox."
    hits = prefix_hits(engine)
    three = chat(client, content, n=3, seed=7, **SAMPLED)
    assert [c.index for c in three.choices] == [0, 1, 2]
    texts = [c.message.content for c in three.choices]
    assert len(set(texts)) == 3, texts  # derived seeds: the choices differ
    assert all(c.finish_reason == "length" for c in three.choices)
    # The prompt counts once, the completions add up.
    one = chat(client, content, n=1, seed=7, **SAMPLED)
    assert three.usage.prompt_tokens == one.usage.prompt_tokens
    assert three.usage.completion_tokens == 3 * 6 == three.usage.total_tokens - three.usage.prompt_tokens
    # Choices 1 and 2 started after choice 0 had prefilled: they read its full prompt blocks from the
    # prefix cache instead of computing them again.
    full = (one.usage.prompt_tokens - 1) // 16 * 16
    assert full > 0 and prefix_hits(engine) - hits >= 2 * full
    # Reproducible: the same seed gives the same choices, and choice 0 is what n=1 gives.
    again = chat(client, content, n=3, seed=7, **SAMPLED)
    assert [c.message.content for c in again.choices] == texts
    assert one.choices[0].message.content == texts[0]
    wait_idle(engine)


def test_chat_n_streaming(client: openai.OpenAI, engine: AsyncLLMEngine) -> None:
    content = "Name a colour."
    expected = [c.message.content for c in chat(client, content, n=3, seed=11, **SAMPLED).choices]
    stream = chat(client, content, n=3, seed=11, stream=True, stream_options={"include_usage": True}, **SAMPLED)
    texts: dict[int, str] = defaultdict(str)
    finish: dict[int, str] = {}
    roles: list[int] = []
    usage = None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            if choice.delta.role:
                roles.append(choice.index)
            texts[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                finish[choice.index] = choice.finish_reason
    assert sorted(roles) == [0, 1, 2] and finish == {0: "length", 1: "length", 2: "length"}
    assert [texts[i] for i in range(3)] == expected
    assert usage is not None and usage.completion_tokens == 18
    wait_idle(engine)


def test_completions_n(client: openai.OpenAI, engine: AsyncLLMEngine) -> None:
    prompt = "Once upon a time, in a village by the sea, there lived an old sailor who"
    kwargs = {"model": "", "prompt": prompt, "n": 3, "seed": 5, "temperature": 1.0, "max_tokens": 5,
              "extra_body": {"ignore_eos": True, "model": None}}
    out = client.completions.create(**kwargs)
    assert [c.index for c in out.choices] == [0, 1, 2] and len({c.text for c in out.choices}) == 3
    single = client.completions.create(**{**kwargs, "n": 1})
    assert out.usage.prompt_tokens == single.usage.prompt_tokens and out.usage.completion_tokens == 15
    assert single.choices[0].text == out.choices[0].text
    texts: dict[int, str] = defaultdict(str)
    for chunk in client.completions.create(**kwargs, stream=True):
        for choice in chunk.choices:
            texts[choice.index] += choice.text
    assert [texts[i] for i in range(3)] == [c.text for c in out.choices]
    wait_idle(engine)


def test_n_limits_and_rules(client: openai.OpenAI, server: ServerThread, engine: AsyncLLMEngine) -> None:
    for n in (0, 17):
        with pytest.raises(openai.BadRequestError, match=r"n must be an integer in \[1, 16\]") as info:
            chat(client, "hi", n=n, max_tokens=2)
        assert info.value.param == "n"
    with pytest.raises(openai.BadRequestError, match="sessions"):
        chat(client, "hi", n=2, max_tokens=2, extra_body={"open_session": True})
    with pytest.raises(openai.BadRequestError, match="sessions"):
        chat(client, "hi", n=2, max_tokens=2, extra_body={"session_id": "sess-x"})
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}
    with pytest.raises(openai.BadRequestError, match="client-side tools"):
        chat(client, "hi", n=2, max_tokens=2, tools=[tool])
    # tool_choice "none" hides the tools: nothing can pause, so n is fine.
    ok = chat(client, "hi", n=2, max_tokens=2, tools=[tool], tool_choice="none")
    assert len(ok.choices) == 2
    bad = httpx.post(server.url + "/v1/completions", json={"prompt": "hi", "n": "2"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "n"
    wait_idle(engine)


def test_n_stream_disconnect_frees_everything(client: openai.OpenAI, engine: AsyncLLMEngine) -> None:
    stream = chat(client, "Tell a long story.", n=3, max_tokens=300, stream=True, extra_body={"ignore_eos": True})
    for i, _ in enumerate(stream):
        if i == 8:
            break
    stream.close()
    wait_idle(engine)  # all three choices aborted, their KV back in the pool


def test_openapi_declares_request_bodies(server: ServerThread) -> None:
    doc = httpx.get(server.url + "/openapi.json").json()
    components = doc["components"]["schemas"]
    for path, model in (("/v1/chat/completions", "ChatCompletionRequest"), ("/v1/completions", "CompletionRequest")):
        body = doc["paths"][path]["post"]["requestBody"]
        assert body["required"] is True
        assert body["content"]["application/json"]["schema"] == {"$ref": f"#/components/schemas/{model}"}
        assert "n" in components[model]["properties"]
    assert "messages" in components["ChatCompletionRequest"]["required"]
    # Nested models are components too, so every reference resolves.
    refs = _refs(doc)
    assert "#/components/schemas/ChatMessage" in refs
    assert all(ref.rsplit("/", 1)[1] in components for ref in refs)


def _refs(node: Any) -> set[str]:
    if isinstance(node, dict):
        own = {node["$ref"]} if isinstance(node.get("$ref"), str) else set()
        return own.union(*(_refs(v) for v in node.values()))
    if isinstance(node, list):
        return set().union(*(_refs(v) for v in node))
    return set()
