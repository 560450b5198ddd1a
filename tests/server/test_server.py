"""The OpenAI-compatible server end to end: a real uvicorn server on a free port, the official
openai client (sync and async), a tiny random Llama on CPU."""
from __future__ import annotations

import asyncio
import time
from typing import Any, Awaitable, Callable, Iterator

import httpx
import openai
import pytest

from conftest import make_tiny_checkpoint
from segue.config import EngineConfig, ModelLoadConfig
from segue.engine.async_engine import AsyncLLMEngine
from segue.engine.calls import Abort, EngineCall
from segue.engine.engine_request import EngineRequest
from segue.engine.llm_engine import LLMEngine
from segue.sampling_params import SamplingParams
from segue.server.app import create_app
from server_helpers import ServerThread

API_KEY = "sk-test-key"
PROMPT = "The quick brown fox"
# Random weights rarely pick EOS, but ignore_eos makes token counts exact.
EXACT = {"ignore_eos": True}


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[AsyncLLMEngine]:
    path = make_tiny_checkpoint(tmp_path_factory.mktemp("server") / "tiny-llama")
    eng = AsyncLLMEngine(LLMEngine(EngineConfig(model=ModelLoadConfig(model=str(path), dtype="float32",
                                                                       device="cpu"))))
    yield eng
    asyncio.run(eng.shutdown())


@pytest.fixture(scope="module")
def server(engine: AsyncLLMEngine) -> Iterator[ServerThread]:
    with ServerThread(create_app(engine)) as s:
        yield s


@pytest.fixture(scope="module")
def client(server: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def model(engine: AsyncLLMEngine) -> str:
    return engine.engine.model_name


def engine_stats(engine: AsyncLLMEngine) -> tuple[int, int]:
    """(KV blocks held, unfinished requests), read on the engine thread between steps."""
    async def read() -> tuple[int, int]:
        return await engine.run_sync(lambda e: (e.scheduler.state.kv.num_held_blocks(), e.num_unfinished_requests))
    return asyncio.run(read())


def wait_idle(engine: AsyncLLMEngine, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while engine_stats(engine) != (0, 0):
        assert time.monotonic() < deadline, f"engine still busy: {engine_stats(engine)}"
        time.sleep(0.05)
    asyncio.run(_check_invariants(engine))


async def _check_invariants(engine: AsyncLLMEngine) -> None:
    await engine.run_sync(lambda e: e.check_invariants())


def test_health_and_models(server: ServerThread, client: openai.OpenAI, model: str) -> None:
    assert httpx.get(server.url + "/health").status_code == 200
    assert [m.id for m in client.models.list().data] == [model]
    assert client.models.retrieve(model).id == model
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")


def test_completion_stream_matches_non_stream(client: openai.OpenAI, model: str, engine: AsyncLLMEngine) -> None:
    full = client.completions.create(model=model, prompt=PROMPT, max_tokens=12, temperature=0, extra_body=EXACT)
    choice = full.choices[0]
    assert full.object == "text_completion" and choice.finish_reason == "length" and choice.text
    prompt_len = len(engine.engine.encode(PROMPT))
    assert (full.usage.prompt_tokens, full.usage.completion_tokens, full.usage.total_tokens) == \
        (prompt_len, 12, prompt_len + 12)

    chunks = list(client.completions.create(model=model, prompt=PROMPT, max_tokens=12, temperature=0,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body=EXACT))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == choice.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12

    # Token-id prompts and a missing model field are accepted too.
    by_ids = client.completions.create(model="", prompt=engine.engine.encode(PROMPT), max_tokens=12,
                                       temperature=0, extra_body={**EXACT, "model": None})
    assert by_ids.choices[0].text == choice.text


def test_chat_async_stream_matches_non_stream(server: ServerThread, model: str) -> None:
    messages = [{"role": "developer", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}]}]

    async def run() -> None:
        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        full = await client.chat.completions.create(model=model, messages=messages, max_tokens=10,
                                                    temperature=0, extra_body=EXACT)
        assert full.object == "chat.completion" and full.choices[0].message.role == "assistant"
        assert full.choices[0].finish_reason == "length" and full.usage.completion_tokens == 10
        assert full.usage.total_tokens == full.usage.prompt_tokens + 10
        stream = await client.chat.completions.create(model=model, messages=messages, max_completion_tokens=10,
                                                      temperature=0, stream=True, extra_body=EXACT,
                                                      stream_options={"include_usage": True})
        chunks = [c async for c in stream]
        assert all(c.object == "chat.completion.chunk" for c in chunks)
        assert chunks[0].choices[0].delta.role == "assistant"
        with_choices = [c for c in chunks if c.choices]
        assert "".join(c.choices[0].delta.content or "" for c in with_choices) == full.choices[0].message.content
        assert with_choices[-1].choices[0].finish_reason == "length"
        # cached_tokens may differ: the rerun hits the prefix cache.
        usage = chunks[-1].usage
        assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == \
            (full.usage.prompt_tokens, 10, full.usage.total_tokens)
        await client.close()

    asyncio.run(run())


def test_stop_string_and_logprobs(client: openai.OpenAI, model: str) -> None:
    base = client.completions.create(model=model, prompt=PROMPT, max_tokens=16, temperature=0, extra_body=EXACT)
    text = base.choices[0].text
    stop = text[len(text) // 2:len(text) // 2 + 2]
    stopped = client.completions.create(model=model, prompt=PROMPT, max_tokens=16, temperature=0, stop=stop,
                                        extra_body=EXACT)
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].text == text[:text.find(stop)]

    lp = client.completions.create(model=model, prompt=PROMPT, max_tokens=5, temperature=0, logprobs=2,
                                   extra_body=EXACT).choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == 5 and all(len(t) <= 2 for t in lp.top_logprobs)
    chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=5,
                                          temperature=0, logprobs=True, top_logprobs=3, extra_body=EXACT)
    content = chat.choices[0].logprobs.content
    assert len(content) == 5 and all(len(c.top_logprobs) == 3 and c.logprob <= 0 for c in content)


def _post(server: ServerThread, path: str, **kwargs: Any) -> httpx.Response:
    return httpx.post(server.url + path, timeout=30, **kwargs)


def _assert_error(r: httpx.Response, status: int) -> dict[str, Any]:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert "Traceback" not in err["message"]
    return err


def test_errors(server: ServerThread, client: openai.OpenAI, model: str, engine: AsyncLLMEngine) -> None:
    r = _post(server, "/v1/completions", content=b'{"prompt": "hi", "max_tokens": ',
              headers={"content-type": "application/json"})
    assert "JSON" in _assert_error(r, 400)["message"]
    err = _assert_error(_post(server, "/v1/completions", json={"prompt": "hi", "max_tokens": "abc"}), 400)
    assert err["param"] == "max_tokens"
    _assert_error(_post(server, "/v1/completions", json={"max_tokens": 3}), 400)  # no prompt
    _assert_error(_post(server, "/v1/chat/completions", json={"messages": "hi"}), 400)
    _assert_error(_post(server, "/v1/nope", json={}), 404)
    # `curl -d` sends JSON as form data; it is parsed as JSON all the same.
    r = _post(server, "/v1/completions", content=b'{"prompt": "hi", "max_tokens": 2}',
              headers={"content-type": "application/x-www-form-urlencoded"})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1

    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(model=model, prompt="hi", max_tokens=0)
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.completions.create(model=model, prompt="hi", max_tokens=2, temperature=-1)
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "hi"}])
    assert info.value.code == "model_not_found"
    too_long = " ".join(["word"] * (engine.engine.max_model_len + 10))
    with pytest.raises(openai.BadRequestError, match="context window"):
        client.completions.create(model=model, prompt=too_long, max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="context window"):
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": too_long}],
                                       max_tokens=2, stream=True)
    bad_tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}
    with pytest.raises(openai.BadRequestError, match="parameters"):
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], tools=[bad_tool])
    with pytest.raises(openai.BadRequestError, match=r"n must be an integer in \[1, 16\]"):
        client.completions.create(model=model, prompt="hi", max_tokens=2, n=17)
    with pytest.raises(openai.BadRequestError, match="image_url"):
        client.chat.completions.create(model=model, max_tokens=2, messages=[
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x"}}]}])

    # The server and engine are unharmed: a normal request still works and nothing leaked.
    ok = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=3)
    assert ok.usage.completion_tokens >= 1
    wait_idle(engine)


def test_value_errors_name_their_param(server: ServerThread, model: str) -> None:
    chat = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    cases = [("/v1/completions", {"prompt": "hi", "max_tokens": 2, "temperature": -1}, "temperature", "invalid_value"),
             ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, "max_tokens", "invalid_value"),
             ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "top_p": 0}, "top_p", "invalid_value"),
             ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "logprobs": 21}, "logprobs", "invalid_value"),
             ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "n": 17}, "n", "invalid_value"),
             ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "echo": True}, "echo", "unsupported_value"),
             ("/v1/chat/completions", {**chat, "temperature": 101}, "temperature", "invalid_value"),
             ("/v1/chat/completions", {**chat, "logprobs": True, "top_logprobs": 21}, "top_logprobs",
              "invalid_value"),
             ("/v1/chat/completions", {**chat, "top_logprobs": 2}, "top_logprobs", "invalid_value"),
             ("/v1/chat/completions", {**chat, "max_completion_tokens": 0}, "max_completion_tokens",
              "invalid_value"),
             ("/v1/chat/completions", {**chat, "presence_penalty": 1.0}, "presence_penalty", "unsupported_value"),
             ("/v1/chat/completions", {**chat, "tool_choice": "sometimes"}, "tool_choice", "invalid_value")]
    for path, body, param, code in cases:
        err = _assert_error(_post(server, path, json=body), 400)
        assert (err["param"], err["code"]) == (param, code), (body, err)
        assert err["type"] == "invalid_request_error" and param in err["message"]


def test_api_keys(engine: AsyncLLMEngine, model: str) -> None:
    with ServerThread(create_app(engine, api_keys=[API_KEY, "other"])) as s:
        assert httpx.get(s.url + "/health").status_code == 200
        _assert_error(httpx.get(s.url + "/v1/models"), 401)
        _assert_error(httpx.get(s.url + "/v1/models", headers={"Authorization": "Basic " + API_KEY}), 401)
        bad = openai.OpenAI(base_url=s.url + "/v1", api_key="sk-wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            bad.completions.create(model=model, prompt="hi", max_tokens=2)
        good = openai.OpenAI(base_url=s.url + "/v1", api_key=API_KEY, max_retries=0)
        assert good.completions.create(model=model, prompt="hi", max_tokens=2).usage.completion_tokens >= 1


def _slow_engine(engine: AsyncLLMEngine, delay: float) -> Callable[[], None]:
    """Make every engine step take `delay` seconds so a long request is surely still running when
    the client leaves; returns the undo. Patched on the engine thread, between steps."""
    def patch(e: LLMEngine) -> None:
        original = e.executor.execute

        def slow(out: Any) -> Any:
            time.sleep(delay)
            return original(out)
        e.executor.execute = slow  # type: ignore[method-assign]

    async def apply(fn: Callable[[LLMEngine], None]) -> None:
        await engine.run_sync(fn)
    asyncio.run(apply(patch))
    return lambda: asyncio.run(apply(lambda e: delattr(e.executor, "execute")))


def _num_steps(engine: AsyncLLMEngine) -> int:
    async def read() -> int:
        return await engine.run_sync(lambda e: e.num_steps)
    return asyncio.run(read())


def test_stream_disconnect_frees_kv(client: openai.OpenAI, model: str, engine: AsyncLLMEngine) -> None:
    undo = _slow_engine(engine, 0.02)
    try:
        steps = _num_steps(engine)
        stream = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}],
                                                max_tokens=400, stream=True, extra_body=EXACT)
        for i, _ in enumerate(stream):
            if i == 3:
                break
        assert engine_stats(engine)[0] > 0  # the request holds KV while it runs
        stream.close()
        wait_idle(engine, timeout=5)
        assert _num_steps(engine) - steps < 100  # aborted, not run to its 400 tokens
    finally:
        undo()


def test_closing_a_stream_at_its_yield_aborts_at_once(engine: AsyncLLMEngine) -> None:
    """Closing generate() while it is parked at its yield (what a non-streaming response does when
    its client leaves between two tokens) aborts the request inside aclose(), not whenever the
    inner consumer is finalized: behind a reference cycle that waited for the garbage collector
    and left the request generating for seconds (seen as a flaky disconnect test)."""
    aborted: list[str] = []
    original = engine.call

    def record(op: EngineCall[Any]) -> Awaitable[Any]:
        if isinstance(op, Abort):
            aborted.append(op.request_id)
        return original(op)

    async def close_after_first() -> list[str]:
        gen = engine.generate(EngineRequest(PROMPT, SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True),
                                            "close-at-yield"))
        await gen.__anext__()
        await gen.aclose()
        seen = list(aborted)
        # Stay on this loop until the abort has gone through the engine.
        deadline = time.monotonic() + 10
        while await engine.run_sync(lambda e: e.num_unfinished_requests):
            assert time.monotonic() < deadline, "the aborted request is still running"
            await asyncio.sleep(0.02)
        return seen

    engine.call = record  # type: ignore[method-assign]
    try:
        assert asyncio.run(close_after_first()) == ["close-at-yield"]
    finally:
        del engine.call
    wait_idle(engine)


def test_non_stream_disconnect_frees_kv(server: ServerThread, model: str, engine: AsyncLLMEngine) -> None:
    undo = _slow_engine(engine, 0.02)
    try:
        steps = _num_steps(engine)
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(server.url + "/v1/completions", json={"model": model, "prompt": PROMPT, "max_tokens": 400,
                                                            "ignore_eos": True}, timeout=0.5)
        wait_idle(engine, timeout=5)
        assert _num_steps(engine) - steps < 150
    finally:
        undo()
