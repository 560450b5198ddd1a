"""Auto-continuation: a plain OpenAI client (no session fields) whose next request extends a held
turn's transcript continues that held request, with nothing recomputed; another tenant or other
tools start fresh; a held turn nobody continues gives its device memory back and then goes away."""
from __future__ import annotations

from typing import Any, Iterator

import openai
import pytest

from segue.async_engine import AsyncLLMEngine
from segue.server.app import create_app
from segue.server.config import ServerConfig
from test_server_sessions import KEY_A, KEY_B, WEATHER, make_client
from test_server_session_turns import CHAT, FOLLOW_UP, GREETING, FirstTurnScript, paused_ids
from test_server_support import (  # noqa: F401  (engine, setup: shared pytest fixtures)
    ScriptedModel, ServerThread, engine, on_engine, setup, wait_until)


@pytest.fixture(scope="module")
def first_turn(engine: AsyncLLMEngine) -> FirstTurnScript:
    def install(e: Any) -> FirstTurnScript:
        wrapper = FirstTurnScript(e, GREETING)
        e.executor.execute = wrapper.execute
        return wrapper
    return on_engine(engine, install)


@pytest.fixture(scope="module")
def server(engine: AsyncLLMEngine) -> Iterator[ServerThread]:
    config = ServerConfig(auto_continue=True, auto_continue_release_s=60.0, auto_continue_ttl_s=120.0)
    with ServerThread(create_app(engine, api_keys=[KEY_A, KEY_B], config=config)) as s:
        yield s


@pytest.fixture(scope="module")
def short_server(engine: AsyncLLMEngine) -> Iterator[ServerThread]:
    config = ServerConfig(auto_continue=True, auto_continue_release_s=0.3, auto_continue_ttl_s=2.0)
    with ServerThread(create_app(engine, api_keys=[KEY_A, KEY_B], config=config)) as s:
        yield s


def plain(client: openai.OpenAI, messages: list[dict], tools: list | None = None, **kwargs: Any) -> Any:
    extra = {"tools": tools} if tools else {}
    kwargs.setdefault("max_tokens", 6)
    return client.chat.completions.create(model="", messages=messages, temperature=0,
                                          extra_body={"model": None}, **extra, **kwargs)


def first_turn_held(client: openai.OpenAI, engine: AsyncLLMEngine, text: str,
                    tools: list | None = None) -> tuple[list[dict], Any, str]:
    messages = [{"role": "user", "content": f"{CHAT} {text}"}]
    before = set(paused_ids(engine))
    first = plain(client, messages, tools, max_tokens=40)
    choice = first.choices[0]
    assert choice.finish_reason == "stop" and choice.message.content == GREETING
    # A plain client is never shown a session id: the hold is the server's business.
    assert first.model_extra.get("session_id") is None
    (rid,) = set(paused_ids(engine)) - before
    history = messages + [{"role": "assistant", "content": GREETING}, {"role": "user", "content": FOLLOW_UP}]
    return history, first, rid


def test_plain_second_turn_continues_held_request(server: ServerThread, engine: AsyncLLMEngine,
                                                  setup: tuple[AsyncLLMEngine, ScriptedModel],
                                                  first_turn: FirstTurnScript) -> None:
    scripted = setup[1]
    a = make_client(server, KEY_A)
    history, first, rid = first_turn_held(a, engine, "Say hello.")
    held = first.usage.total_tokens
    assert held == on_engine(engine, lambda e: e.scheduler.requests[rid].num_tokens)
    steps_before = len(scripted.seen[rid].chunks)
    second = a.chat.completions.create(model="", messages=history, temperature=0, max_tokens=6,
                                       extra_body={"model": None, "ignore_eos": True})
    # The held request went on (no new request): its new chunks start at the held end-of-turn
    # token and carry the user's message; every held token counts as cached, none is recomputed.
    resumed = scripted.seen[rid].chunks[steps_before:]
    assert resumed and resumed[0][0] == held - 1 and all(start >= held - 1 for start, _ in resumed)
    assert second.usage.prompt_tokens_details.cached_tokens == held
    assert second.usage.prompt_tokens == len(first_turn.contexts[(rid, 1)])
    assert first_turn.contexts[(rid, 1)][:len(first_turn.contexts[(rid, 0)])] == first_turn.contexts[(rid, 0)]
    assert on_engine(engine, lambda e: e.scheduler.last_step_recompute_tokens) == 0
    assert second.model_extra.get("session_id") is None
    on_engine(engine, lambda e: e.check_invariants())
    assert server.app.state.serving.auto.hits >= 1


def test_other_tenant_or_tools_start_fresh(server: ServerThread, engine: AsyncLLMEngine,
                                           first_turn: FirstTurnScript) -> None:
    a, b = make_client(server, KEY_A), make_client(server, KEY_B)
    history, first, rid = first_turn_held(a, engine, "Greet tenant A.")
    hits = server.app.state.serving.auto.hits
    other_key = b.chat.completions.create(model="", messages=history, temperature=0, max_tokens=4,
                                          extra_body={"model": None, "ignore_eos": True})
    # Tenant B cannot continue tenant A's request (nor reuse its prefix: per-key isolation).
    assert other_key.usage.prompt_tokens_details.cached_tokens == 0
    other_tools = plain(a, history, tools=[WEATHER])
    assert other_tools.usage.prompt_tokens_details.cached_tokens < first.usage.total_tokens
    assert server.app.state.serving.auto.hits == hits
    # A's held turn is still there for A's own continuation.
    assert rid in paused_ids(engine)
    mine = a.chat.completions.create(model="", messages=history, temperature=0, max_tokens=4,
                                     extra_body={"model": None, "ignore_eos": True})
    assert mine.usage.prompt_tokens_details.cached_tokens == first.usage.total_tokens
    assert server.app.state.serving.auto.hits == hits + 1


def test_abandoned_held_turn_releases_memory(short_server: ServerThread, engine: AsyncLLMEngine,
                                             first_turn: FirstTurnScript) -> None:
    a = make_client(short_server, KEY_A)
    _, _, rid = first_turn_held(a, engine, "Say hello, then leave.")
    # Past auto_continue_release_s the held turn keeps no private device blocks (they went back to
    # the prefix cache); past auto_continue_ttl_s the request is gone altogether.
    wait_until(lambda: on_engine(engine, lambda e: e.scheduler.kv.num_device_blocks_of(rid)) == 0
               or rid not in paused_ids(engine), timeout=5.0, what="the held turn's device blocks released")
    on_engine(engine, lambda e: e.check_invariants())
    wait_until(lambda: rid not in paused_ids(engine), timeout=10.0, what="the abandoned turn dropped")
    on_engine(engine, lambda e: e.check_invariants())
