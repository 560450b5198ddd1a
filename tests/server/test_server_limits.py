"""Limits, metrics and server config: 429 over the concurrency cap, 504 past the request timeout,
413 for large bodies, the Prometheus names, and the `--config` file."""
from __future__ import annotations

import json
import pathlib
import threading
from typing import Any, Iterator

import httpx
import openai
import pytest

from segue.engine.async_engine import AsyncLLMEngine
from segue.server.app import create_app
from segue.server.config import ServerConfig, ServerConfigError, load_server_config
from segue.tools.registry import ToolRegistry
from server_helpers import (
    ScriptedModel,
    ServerThread,
    call_text,
    engine_fixture,
    num_paused,
    wait_idle,
    wait_until,
)


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[AsyncLLMEngine, ScriptedModel]]:
    yield from engine_fixture(tmp_path_factory)


@pytest.fixture(scope="module")
def engine(setup: tuple[AsyncLLMEngine, ScriptedModel]) -> AsyncLLMEngine:
    setup[1].script("[slow]", call_text("wait", {"seconds": 1.0}), "Done.")
    setup[1].script("[calc]", call_text("calculator", {"expression": "2*2"}), "4")
    return setup[0]


def tools() -> ToolRegistry:
    return ToolRegistry.from_config({"tools": [{"builtin": "wait"}, {"builtin": "calculator"}]})


def ask(url: str, text: str, extra_body: dict | None = None) -> Any:
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=60)
    return client.chat.completions.create(model="", messages=[{"role": "user", "content": text}], max_tokens=40,
                                          temperature=0, extra_body={"model": None, **(extra_body or {})})


def test_concurrency_cap_gives_429(engine: AsyncLLMEngine) -> None:
    with ServerThread(create_app(engine, tools=tools(), config=ServerConfig(max_concurrent_requests=1))) as s:
        results: dict[str, Any] = {}
        busy = threading.Thread(target=lambda: results.update(slow=ask(s.url, "[slow] hold the slot")))
        busy.start()
        wait_until(lambda: num_paused(engine) == 1, what="the first request to be in its tool call")
        with pytest.raises(openai.RateLimitError) as info:
            ask(s.url, "one too many")
        assert info.value.code == "too_many_requests" and info.value.response.headers["retry-after"] == "1"
        busy.join(30)
        assert results["slow"].choices[0].message.content == "Done."
        assert ask(s.url, "room again", extra_body={"ignore_eos": True}).usage.completion_tokens == 40
    wait_idle(engine)


def test_request_timeout_aborts_with_504(engine: AsyncLLMEngine) -> None:
    with ServerThread(create_app(engine, tools=tools(), config=ServerConfig(request_timeout_s=0.4))) as s:
        with pytest.raises(openai.APIStatusError) as info:
            ask(s.url, "[slow] too slow")
        assert info.value.status_code == 504 and info.value.code == "request_timeout"
        chunks = httpx.post(s.url + "/v1/chat/completions", timeout=30, json={
            "messages": [{"role": "user", "content": "[slow] streamed"}], "max_tokens": 40, "stream": True}).text
        assert "request_timeout" in chunks and chunks.rstrip().endswith("data: [DONE]")
    wait_idle(engine)


def test_body_size_limit(engine: AsyncLLMEngine) -> None:
    with ServerThread(create_app(engine, config=ServerConfig(max_body_bytes=1000))) as s:
        big = {"messages": [{"role": "user", "content": "x" * 2000}]}
        r = httpx.post(s.url + "/v1/chat/completions", json=big, timeout=30)
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"

        def chunked() -> Iterator[bytes]:  # no Content-Length: counted as it arrives
            yield json.dumps(big).encode()
        r = httpx.post(s.url + "/v1/chat/completions", content=chunked(), timeout=30)
        assert r.status_code == 413
        small = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        assert httpx.post(s.url + "/v1/chat/completions", json=small, timeout=30).status_code == 200
    wait_idle(engine)


def test_metrics_exposes_engine_and_server_numbers(engine: AsyncLLMEngine) -> None:
    with ServerThread(create_app(engine, tools=tools(), api_keys=["k"])) as s:
        client = openai.OpenAI(base_url=s.url + "/v1", api_key="k", max_retries=0, timeout=60)
        client.chat.completions.create(model="", messages=[{"role": "user", "content": "[calc] twice two"}],
                                       max_tokens=40, extra_body={"model": None})
        client.completions.create(model="", prompt="hello", max_tokens=3, extra_body={"model": None})
        text = httpx.get(s.url + "/metrics").text  # open to scrapers without a key
    for name in ("segue_http_requests_total", "segue_queue_requests", "segue_kv_blocks", "segue_paused_requests",
                 "segue_paused_kv_blocks", "segue_kv_waste_gb_seconds_total", "segue_preemptions_total",
                 "segue_prefix_cache_hit_tokens_total", "segue_time_to_first_token_seconds_bucket",
                 "segue_time_per_output_token_seconds_bucket", "segue_e2e_request_latency_seconds_bucket",
                 "segue_tool_calls_total", "segue_tool_duration_seconds", "segue_sessions",
                 "segue_requests_in_flight", "segue_engine_step_seconds_total",
                 "segue_engine_modelled_step_seconds_total"):
        assert name in text, name
    assert 'segue_http_requests_total{endpoint="/v1/chat/completions",status="200"} 1.0' in text
    assert 'segue_tool_calls_total{outcome="ok",side="server",tool="calculator"} 1.0' in text
    assert 'segue_tool_duration_seconds{stat="mean",tool="calculator"}' in text
    assert 'segue_kv_blocks{kind="total",pool="device"} 512.0' in text
    wait_idle(engine)


def test_config_file(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "serve.json"
    path.write_text(json.dumps({"max_concurrent_requests": 3, "session_ttl_s": 30, "api_keys": ["a"],
                                "tools": [{"builtin": "calculator"}, {"builtin": "wait", "max_seconds": 5}]}))
    config, registry = load_server_config(path)
    assert (config.max_concurrent_requests, config.session_ttl_s, config.api_keys) == (3, 30, ["a"])
    assert registry.names() == ["calculator", "wait"]
    (tmp_path / "serve.toml").write_text('request_timeout_s = 5.0\n[[tools]]\nbuiltin = "calculator"\n')
    config, registry = load_server_config(tmp_path / "serve.toml")
    assert config.request_timeout_s == 5.0 and registry.names() == ["calculator"]
    assert load_server_config(None)[0] == ServerConfig()
    for bad in ({"max_concurent_requests": 3}, {"max_sessions": 0}, {"prefix_cache_isolation": "maybe"},
                {"tools": [{"builtin": "nope"}]}):
        path.write_text(json.dumps(bad))
        with pytest.raises(ServerConfigError):
            load_server_config(path)
