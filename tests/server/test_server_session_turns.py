"""Human turns in sessions: a session's turn that ends normally (a stop) or is cut off by max_tokens
keeps its request paused, and the user's reply continues it with the same context and output a
fresh request with the whole history gets, without recomputing anything held."""
from __future__ import annotations

import dataclasses
from typing import Any, Iterator

import pytest
from test_server_sessions import KEY_A, KEY_B, chat, close, make_client, scripted_text

from segue.engine.async_engine import AsyncLLMEngine
from segue.program.registry import scoped_program_id
from segue.server.app import create_app
from segue.server.auth import tenant_id
from segue.server.config import ServerConfig
from server_helpers import (
    ScriptedModel,
    ServerThread,
    encode,
    engine_stats,
    on_engine,
    wait_idle,
    wait_until,
)


@pytest.fixture(scope="module")
def scripted(setup: tuple[AsyncLLMEngine, ScriptedModel]) -> ScriptedModel:
    return setup[1]


@pytest.fixture(scope="module")
def server(engine: AsyncLLMEngine) -> Iterator[ServerThread]:
    with ServerThread(create_app(engine, api_keys=[KEY_A, KEY_B])) as s:
        yield s


# ---- human turns: a session's turn that ends normally keeps its context ------------------------
CHAT = "[chat]"
FOLLOW_UP = "Go on, please."
GREETING = "Hello there, friend."  # what CHAT requests write in their first turn


class FirstTurnScript:
    """Wraps the executor: requests whose prompt has CHAT (and not FOLLOW_UP) write `text` then EOS
    in their first turn; every later token is the real model's greedy choice. Also records the
    context each request had when it sampled the first token of each turn."""

    def __init__(self, engine: Any, text: str) -> None:
        self.inner = engine.executor.execute
        self.eos = engine.model_config.eos_token_ids[0]
        self.tokens = encode(text)
        self.contexts: dict[tuple[str, int], list[int]] = {}
        self.programs: dict[str, str | None] = {}
        self._scripted: dict[str, bool] = {}

    def _is_scripted(self, req: Any) -> bool:
        if req.request_id not in self._scripted:
            prompt = scripted_text(req.prompt_token_ids)
            self._scripted[req.request_id] = CHAT in prompt and FOLLOW_UP not in prompt
        return self._scripted[req.request_id]

    def execute(self, out: Any) -> Any:
        sampled = self.inner(out)
        for seq in out.seqs:
            req = seq.request
            if not seq.sample:
                continue
            self.contexts.setdefault((req.request_id, len(req.interceptions)), list(req.all_token_ids))
            self.programs[req.request_id] = req.program_id
            if self._is_scripted(req) and not req.interceptions:
                pos = req.num_output_tokens
                token = self.tokens[pos] if pos < len(self.tokens) else self.eos
                sampled[req.request_id] = dataclasses.replace(sampled[req.request_id], token_id=token)
        return sampled


@pytest.fixture(scope="module")
def first_turn(engine: AsyncLLMEngine, scripted: ScriptedModel) -> FirstTurnScript:
    def install(e: Any) -> FirstTurnScript:
        wrapper = FirstTurnScript(e, GREETING)
        e.executor.execute = wrapper.execute
        return wrapper
    return on_engine(engine, install)


def paused_ids(engine: AsyncLLMEngine) -> list[str]:
    return on_engine(engine, lambda e: list(e.scheduler.state.paused.paused))


def test_human_turn_keeps_context(server: ServerThread, engine: AsyncLLMEngine, scripted: ScriptedModel,
                                  first_turn: FirstTurnScript) -> None:
    a = make_client(server, KEY_A)
    messages = [{"role": "user", "content": f"{CHAT} Say hello."}]
    first = chat(a, messages, extra_body={"open_session": True})
    choice = first.choices[0]
    assert choice.finish_reason == "stop" and choice.message.content == GREETING
    session = first.model_extra["session_id"]
    # The turn ended at EOS, but the request is paused (end-of-turn token kept), not finished.
    (rid,) = paused_ids(engine)
    held = first.usage.total_tokens
    assert held == on_engine(engine, lambda e: e.scheduler.state.requests[rid].num_tokens)
    on_engine(engine, lambda e: e.check_invariants())

    history = messages + [choice.message.model_dump(exclude_none=True), {"role": "user", "content": FOLLOW_UP}]
    steps_before = len(scripted.seen[rid].chunks)
    second = chat(a, history, session, max_tokens=6, extra_body={"ignore_eos": True})
    assert second.choices[0].finish_reason == "length" and second.model_extra["session_id"] == session
    # The same engine request continued: nothing of the first turn was computed again. Its first
    # new chunk starts at the held EOS (sampled, not yet computed) and carries the user's turn.
    resumed = scripted.seen[rid].chunks[steps_before:]
    assert resumed[0][0] == held - 1 and all(start >= held - 1 for start, _ in resumed)
    assert resumed[0][1][0] == first_turn.eos and FOLLOW_UP in scripted_text(resumed[0][1])
    assert second.usage.prompt_tokens_details.cached_tokens == held
    assert on_engine(engine, lambda e: e.scheduler.state.last_step_recompute_tokens) == 0
    # Cut off by max_tokens, the second turn is held too (when its tokens re-encode to themselves).
    assert paused_ids(engine) in ([], [rid])

    # A fresh request with the full history sees exactly the continued request's context and,
    # greedy, writes exactly the same tokens.
    fresh = chat(a, history, max_tokens=6, extra_body={"ignore_eos": True})
    fresh_rid = next(r for (r, turn) in first_turn.contexts if turn == 0 and r not in (rid,)
                     and first_turn.contexts[(r, 0)] == first_turn.contexts[(rid, 1)])
    assert fresh_rid
    assert fresh.choices[0].message.content == second.choices[0].message.content
    assert fresh.usage.prompt_tokens == second.usage.prompt_tokens
    assert close(server, session, KEY_A) == 200
    wait_idle(engine)


def test_human_turn_streamed_then_closed(server: ServerThread, engine: AsyncLLMEngine,
                                         first_turn: FirstTurnScript) -> None:
    a = make_client(server, KEY_A)
    messages = [{"role": "user", "content": f"{CHAT} Stream a greeting."}]
    chunks = list(chat(a, messages, stream=True, extra_body={"open_session": True}))
    with_choices = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].delta.content or "" for c in with_choices) == GREETING
    assert with_choices[-1].choices[0].finish_reason == "stop"
    session = with_choices[-1].model_extra["session_id"]
    assert len(paused_ids(engine)) == 1 and engine_stats(engine)[0] > 0
    assert close(server, session, KEY_A) == 200
    wait_idle(engine)  # closing aborted the held request: its KV is back in the pool


def test_human_turn_edge_cases(server: ServerThread, engine: AsyncLLMEngine, first_turn: FirstTurnScript) -> None:
    a = make_client(server, KEY_A)
    # Outside a session nothing is held: the turn finishes as always.
    plain = chat(a, [{"role": "user", "content": f"{CHAT} No session."}])
    assert plain.choices[0].finish_reason == "stop" and "session_id" not in (plain.model_extra or {})
    wait_idle(engine)
    # A stop string ends the turn on text the client never sees: held all the same, and the next
    # turn replaces the stop string's tokens with what the history renders to.
    messages = [{"role": "user", "content": f"{CHAT} Cut me."}]
    cut = chat(a, messages, stop=[" friend"], extra_body={"open_session": True})
    assert cut.choices[0].finish_reason == "stop" and cut.choices[0].message.content == "Hello there,"
    (rid,) = paused_ids(engine)
    continued_as_fresh(server, engine, first_turn, rid, messages, cut)
    wait_idle(engine)
    # An edited history cannot continue the held request: it is aborted and a fresh one starts.
    messages = [{"role": "user", "content": f"{CHAT} Edit me."}]
    first = chat(a, messages, extra_body={"open_session": True})
    session = first.model_extra["session_id"]
    (held_rid,) = paused_ids(engine)
    edited = [{"role": "assistant", "content": "Something else."} if m["role"] == "assistant" else m
              for m in messages + [first.choices[0].message.model_dump(exclude_none=True)]]
    again = chat(a, edited + [{"role": "user", "content": FOLLOW_UP}], session, max_tokens=4,
                 extra_body={"ignore_eos": True})
    assert again.choices[0].finish_reason == "length" and again.usage.prompt_tokens_details.cached_tokens \
        < again.usage.prompt_tokens
    assert held_rid not in paused_ids(engine)
    # The fresh request of a session counts as the session's program (program-level policies),
    # named within its API key's scope.
    assert list(first_turn.programs.values())[-1] == scoped_program_id(tenant_id(KEY_A.encode()), session)
    assert close(server, session, KEY_A) == 200
    wait_idle(engine)


@pytest.mark.parametrize("cut", [False, True], ids=["stop", "length"])
def test_held_human_turn_expires(engine: AsyncLLMEngine, first_turn: FirstTurnScript, cut: bool) -> None:
    with ServerThread(create_app(engine, config=ServerConfig(session_ttl_s=0.3))) as s:
        a = make_client(s, "none")
        first = chat(a, [{"role": "user", "content": f"{CHAT} expire me"}], extra_body={"open_session": True},
                     max_tokens=len(encode(GREETING)) if cut else 80)
        assert first.choices[0].finish_reason == ("length" if cut else "stop")
        wait_until(lambda: engine_stats(engine) == (0, 0), 5, "the idle session to expire")
        on_engine(engine, lambda e: e.check_invariants())
    wait_idle(engine)


# ---- turns cut off by max_tokens are held too (pause_on_length) --------------------------------
def held_state(engine: AsyncLLMEngine, rid: str) -> tuple[list[int], int, float | None]:
    """(tokens held, KV blocks held, the pause's expected duration) of a paused request."""
    def read(e: Any) -> tuple[list[int], int, float | None]:
        state = e.scheduler.state
        req = state.paused.paused[rid]
        return list(req.all_token_ids), state.kv.num_device_blocks_of(rid), req.interception.expected_duration
    return on_engine(engine, read)


def test_length_turn_is_held_and_continued(server: ServerThread, engine: AsyncLLMEngine, scripted: ScriptedModel,
                                           first_turn: FirstTurnScript) -> None:
    a = make_client(server, KEY_A)
    n = len(encode(GREETING))
    messages = [{"role": "user", "content": f"{CHAT} Greet me, briefly."}]
    first = chat(a, messages, max_tokens=n, extra_body={"open_session": True, "expected_tool_seconds": 7.5})
    choice = first.choices[0]
    # The client sees the usual end of a cut-off turn...
    assert choice.finish_reason == "length" and choice.message.content == GREETING
    session = first.model_extra["session_id"]
    # ...but the request is paused, not finished: its context ends with the last generated token
    # (no end-of-turn token), its KV stays, and the client's estimate is the pause's duration.
    (rid,) = paused_ids(engine)
    held = first.usage.total_tokens
    tokens, blocks, expected = held_state(engine, rid)
    assert len(tokens) == held and tokens[-n:] == encode(GREETING) and expected == 7.5
    assert blocks * 16 >= held - 1  # every computed token's KV (the last one is computed on resume)
    on_engine(engine, lambda e: e.check_invariants())

    history = messages + [choice.message.model_dump(exclude_none=True), {"role": "user", "content": FOLLOW_UP}]
    steps_before = len(scripted.seen[rid].chunks)
    second = chat(a, history, session, max_tokens=6, extra_body={"ignore_eos": True})
    assert second.choices[0].finish_reason == "length" and second.model_extra["session_id"] == session
    # The same request continued with zero recompute: its first chunk starts at the held last token
    # and goes on with the text that closes the assistant message, then the user's turn.
    resumed = scripted.seen[rid].chunks[steps_before:]
    assert resumed[0][0] == held - 1 and all(start >= held - 1 for start, _ in resumed)
    assert resumed[0][1][0] == encode(GREETING)[-1]
    assert scripted_text(resumed[0][1][1:]).startswith(f"<|im_end|>\n<|im_start|>user\n{FOLLOW_UP}<|im_end|>")
    assert second.usage.prompt_tokens_details.cached_tokens == held
    assert second.usage.prompt_tokens == held + len(resumed[0][1]) - 1

    # A fresh request with the whole history (no session: nothing is held after it) starts from
    # exactly the continued request's context and, greedy, writes the same tokens.
    paused_before = paused_ids(engine)
    fresh = chat(a, history, max_tokens=6, extra_body={"ignore_eos": True})
    assert fresh.choices[0].finish_reason == "length" and "session_id" not in (fresh.model_extra or {})
    assert [r for (r, turn) in first_turn.contexts if turn == 0 and r != rid
            and first_turn.contexts[(r, 0)] == first_turn.contexts[(rid, 1)]]
    assert fresh.choices[0].message.content == second.choices[0].message.content
    assert fresh.usage.prompt_tokens == second.usage.prompt_tokens
    assert paused_ids(engine) == paused_before
    on_engine(engine, lambda e: e.check_invariants())
    assert close(server, session, KEY_A) == 200
    wait_idle(engine)  # closing aborted whatever the session held


def test_length_turn_without_session_or_streamed(server: ServerThread, engine: AsyncLLMEngine,
                                                 first_turn: FirstTurnScript) -> None:
    a = make_client(server, KEY_A)
    n = len(encode(GREETING))
    # Outside a session a cut-off turn finishes as always.
    plain = chat(a, [{"role": "user", "content": f"{CHAT} No session here."}], max_tokens=n)
    assert plain.choices[0].finish_reason == "length" and plain.choices[0].message.content == GREETING
    assert "session_id" not in (plain.model_extra or {})
    wait_idle(engine)
    # Streamed, as the benchmark client calls: held the same way, closing frees it.
    chunks = list(chat(a, [{"role": "user", "content": f"{CHAT} Stream, cut."}], max_tokens=n, stream=True,
                       extra_body={"open_session": True}))
    with_choices = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].delta.content or "" for c in with_choices) == GREETING
    assert with_choices[-1].choices[0].finish_reason == "length"
    assert len(paused_ids(engine)) == 1 and engine_stats(engine)[0] > 0
    on_engine(engine, lambda e: e.check_invariants())
    assert close(server, with_choices[-1].model_extra["session_id"], KEY_A) == 200
    wait_idle(engine)


def test_context_window_still_finishes(server: ServerThread, engine: AsyncLLMEngine) -> None:
    """A session's turn that runs into the context window (2048 here) finishes: nothing would fit after it."""
    a = make_client(server, KEY_A)
    long_prompt = [{"role": "user", "content": "hello " * 1850}]
    out = chat(a, long_prompt, max_tokens=1000, extra_body={"open_session": True, "ignore_eos": True})
    assert out.choices[0].finish_reason == "length" and out.usage.total_tokens == 2048
    assert paused_ids(engine) == []
    wait_idle(engine)
    assert close(server, out.model_extra["session_id"], KEY_A) == 200


def continued_as_fresh(server: ServerThread, engine: AsyncLLMEngine, first_turn: FirstTurnScript, rid: str,
                       messages: list[dict], first: Any) -> None:
    """Continue a held turn whose tokens are not what its text renders to: the same request goes on,
    cut back to the longest prefix it shares with the rendered history, and holds exactly the
    context a fresh request with the whole history gets (so, greedy, writes the same)."""
    a = make_client(server, KEY_A)
    session = first.model_extra["session_id"]
    held = len(held_state(engine, rid)[0])
    history = messages + [first.choices[0].message.model_dump(exclude_none=True),
                          {"role": "user", "content": FOLLOW_UP}]
    second = chat(a, history, session, max_tokens=3, extra_body={"ignore_eos": True})
    assert second.model_extra["session_id"] == session and (rid, 1) in first_turn.contexts
    kept = second.usage.prompt_tokens_details.cached_tokens
    assert 0 < kept < held and kept < second.usage.prompt_tokens and second.usage.completion_tokens == 3
    assert close(server, session, KEY_A) == 200
    fresh = chat(a, history, max_tokens=3, extra_body={"ignore_eos": True})
    fresh_rid = [r for (r, turn) in first_turn.contexts if turn == 0 and r != rid][-1]
    assert first_turn.contexts[(fresh_rid, 0)] == first_turn.contexts[(rid, 1)]
    assert fresh.choices[0].message.content == second.choices[0].message.content
    assert fresh.usage.prompt_tokens == second.usage.prompt_tokens
    on_engine(engine, lambda e: e.check_invariants())


def test_length_turn_with_other_tokens_than_its_text_is_held_and_cut(server: ServerThread, engine: AsyncLLMEngine,
                                                                     first_turn: FirstTurnScript) -> None:
    """Tokens that are not what their text encodes to (here one token per character): a fresh
    request would hold other tokens, so the next turn cuts them and computes the rendered ones."""
    a = make_client(server, KEY_A)
    spelled = [t for ch in "Hello" for t in encode(ch)]
    saved, first_turn.tokens = first_turn.tokens, spelled
    try:
        messages = [{"role": "user", "content": f"{CHAT} Spell it."}]
        first = chat(a, messages, max_tokens=len(spelled), extra_body={"open_session": True})
    finally:
        first_turn.tokens = saved
    assert first.choices[0].finish_reason == "length" and first.choices[0].message.content == "Hello"
    (rid,) = paused_ids(engine)
    continued_as_fresh(server, engine, first_turn, rid, messages, first)
    wait_idle(engine)
