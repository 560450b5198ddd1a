"""Auto-continuation: a plain OpenAI client (no session fields) whose next request extends a held
turn's transcript continues that held request, with nothing recomputed; another tenant or other
tools start fresh; a held turn nobody continues gives its device memory back and then goes away."""
from __future__ import annotations

from typing import Any, Iterator

import openai
import pytest
from test_server_session_turns import CHAT, FOLLOW_UP, GREETING, FirstTurnScript, paused_ids
from test_server_sessions import KEY_A, KEY_B, WEATHER, close, make_client

from segue.engine.async_engine import AsyncLLMEngine
from segue.server.app import create_app
from segue.server.auto_continue import AutoContinuation
from segue.server.config import ServerConfig
from segue.server.sessions import HeldConversation, HeldRequest, OutputMark, SessionStore
from server_helpers import ScriptedModel, ServerThread, on_engine, wait_until


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


class FakeClock:
    """The sessions' clock, moved by the test: what is due when depends on it alone, never on
    how fast a loaded machine runs the test."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture(scope="module")
def short_server(engine: AsyncLLMEngine) -> Iterator[ServerThread]:
    # Release after 4 s idle and drop after 10 s on the fake clock; the background sweeps look
    # every second of real time (app.py) and act only on what the fake clock makes due.
    config = ServerConfig(auto_continue=True, auto_continue_release_s=4.0, auto_continue_ttl_s=10.0)
    app = create_app(engine, api_keys=[KEY_A, KEY_B], config=config)
    app.state.serving.sessions.clock = FakeClock()
    with ServerThread(app) as s:
        yield s


@pytest.fixture(scope="module")
def full_server(engine: AsyncLLMEngine) -> Iterator[ServerThread]:
    config = ServerConfig(auto_continue=True, max_sessions=1, auto_continue_release_s=60.0,
                          auto_continue_ttl_s=120.0)
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
    assert held == on_engine(engine, lambda e: e.scheduler.state.requests[rid].num_tokens)
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
    assert on_engine(engine, lambda e: e.scheduler.state.last_step_recompute_tokens) == 0
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
    clock = short_server.app.state.serving.sessions.clock
    _, _, rid = first_turn_held(a, engine, "Say hello, then leave.")
    assert on_engine(engine, lambda e: e.scheduler.state.kv.num_device_blocks_of(rid)) > 0
    # Past auto_continue_release_s the held turn keeps no device blocks (they went back to the
    # prefix cache) but is still held: its TTL has not passed.
    clock.now += 5.0
    wait_until(lambda: on_engine(engine, lambda e: e.scheduler.state.kv.num_device_blocks_of(rid)) == 0,
               timeout=30.0, what="the held turn's device blocks released")
    assert rid in paused_ids(engine)
    on_engine(engine, lambda e: e.check_invariants())
    # Past auto_continue_ttl_s the request is gone altogether.
    clock.now += 6.0
    wait_until(lambda: rid not in paused_ids(engine), timeout=30.0, what="the abandoned turn dropped")
    on_engine(engine, lambda e: e.check_invariants())


def test_implicit_sessions_stay_within_max_sessions():
    """A plain turn's hold takes a session only when one is free or an idle implicit one can give
    way; explicit and busy sessions never do (before: it opened one past max_sessions)."""
    clock = FakeClock()
    aborted: list[str] = []
    store = SessionStore(aborted.append, ttl_s=100.0, max_sessions=2, clock=clock)
    auto = AutoContinuation(store, engine=None, release_s=4.0, ttl_s=10.0)
    explicit = store.create("t")
    store.checkin(explicit)                 # idle, not expired: it stays
    busy = auto.open("t")                   # an implicit session whose turn is still running
    assert busy is not None and len(store) == 2
    assert auto.open("t") is None and len(store) == 2
    store.hold(busy, HeldRequest("held-1", [1, 2], HeldConversation([], "", []), OutputMark(), None))
    store.checkin(busy)                     # now idle: it gives way to the newer turn
    newer = auto.open("t")
    assert newer is not None and len(store) == 2 and aborted == ["held-1"]
    clock.now += 101.0                      # the explicit one expires: room again
    assert auto.open("u") is not None and len(store) == 2


def test_plain_turn_is_not_held_when_sessions_are_full(full_server: ServerThread, engine: AsyncLLMEngine,
                                                       first_turn: FirstTurnScript) -> None:
    a = make_client(full_server, KEY_A)
    store = full_server.app.state.serving.sessions
    messages = [{"role": "user", "content": f"{CHAT} Hold this one."}]
    opened = a.chat.completions.create(model="", messages=messages, temperature=0, max_tokens=40,
                                       extra_body={"model": None, "open_session": True})
    assert opened.model_extra["session_id"] and len(store) == 1
    before = set(paused_ids(engine))
    answer = plain(a, [{"role": "user", "content": f"{CHAT} No room for me."}], max_tokens=40)
    # The client gets its answer; the turn is simply not held (no session past the limit).
    assert answer.choices[0].message.content == GREETING and answer.model_extra.get("session_id") is None
    assert len(store) == 1
    wait_until(lambda: set(paused_ids(engine)) <= before, what="the unheld turn's request gone")
    on_engine(engine, lambda e: e.check_invariants())
    assert close(full_server, opened.model_extra["session_id"], KEY_A) == 200
