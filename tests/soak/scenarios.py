"""The request mix: each scenario is one client behaviour, normal or faulty, and checks its answers.

Scripted prompts (server.SCRIPTS) make the model call tools, so their content is known exactly;
unscripted prompts get random text and are checked for shape only. Faults are injected by the
client (disconnects, timeouts, cancellations, abandoned sessions, malformed input) or by the
operator's tools (raising, hanging); each is tallied by kind.
"""
from __future__ import annotations

import asyncio
import time
from typing import Any, Awaitable, Callable

import httpx

from .client import Chat, Client, sse_events
from .server import EXPECTED_CONTENT, RESUMED_CONTENT, WEATHER

Scenario = Callable[[Client], Awaitable[None]]
# Long enough that a disconnect or client timeout lands mid-generation on this tiny model.
LONG_TOKENS = 300


def _user(text: str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": text}]


def _expect(c: Client, scenario: str, ok: bool, what: str) -> bool:
    if not ok:
        c.tally.wrong(scenario, what)
    return ok


def _ok_chat(c: Client, scenario: str, r: Chat, content: str | None = None,
             finish: tuple[str, ...] = ("stop",)) -> bool:
    if r.status != 200 or r.error is not None:
        return _expect(c, scenario, False, f"status {r.status}, error {r.error}")
    if not r.done:
        return _expect(c, scenario, False, "stream ended without [DONE]")
    if content is not None and r.content != content:
        return _expect(c, scenario, False, f"content {r.content!r}, wanted {content!r}")
    return _expect(c, scenario, r.finish_reason in finish, f"finish_reason {r.finish_reason!r}, wanted {finish}")


# ---- plain generation ----------------------------------------------------------------------------
async def completion(c: Client) -> None:
    stream = c.rng.random() < 0.4
    body = {"prompt": f"Once upon a time {c.unique()}", "max_tokens": c.rng.randint(4, 24), "stream": stream,
            "temperature": c.rng.choice([0.0, 0.8])}
    if not stream:
        r = await c.send("POST", "/v1/completions", json=body)
        ok = r.status_code == 200 and r.json()["choices"][0]["finish_reason"] in ("stop", "length")
        _expect(c, "completion", ok, f"status {r.status_code}: {r.text[:200]}")
        return
    async with c.http.stream("POST", "/v1/completions", json=body) as r:
        c.record(r.status_code)
        events = [e async for e in sse_events(r)] if r.status_code == 200 else []
    errors = [e for e in events if isinstance(e, dict) and "error" in e]
    c.tally.inband_errors += len(errors)
    _expect(c, "completion", r.status_code == 200 and events[-1:] == ["[DONE]"] and not errors,
            f"stream status {r.status_code}, last event {events[-1:]}, errors {errors[:1]}")


async def chat(c: Client) -> None:
    body = {"messages": _user(f"Tell me something {c.unique()}"), "max_tokens": c.rng.randint(4, 24),
            "stream": c.rng.random() < 0.5, "stream_options": {"include_usage": True}}
    if c.rng.random() < 0.3:
        body["tool_choice"] = "none"
    r = await c.chat(body)
    _ok_chat(c, "chat", r, finish=("stop", "length"))


# ---- server-side tools: one response whatever the tools do -----------------------------------------
def _tool_scenario(marker: str, faults: tuple[str, ...]) -> Scenario:
    async def run(c: Client) -> None:
        for fault in faults:
            c.tally.fault(fault)
        body = {"messages": _user(f"{marker} go {c.unique()}"), "max_tokens": 160, "temperature": 0,
                "stream": c.rng.random() < 0.5}
        _ok_chat(c, run.__name__, await c.chat(body), EXPECTED_CONTENT[marker])
    run.__name__ = "tool_" + marker.strip("[]").replace("tool-", "")
    return run


tool_ok = _tool_scenario("[tool-ok]", ())
tool_fail = _tool_scenario("[tool-fail]", ("tool_raises",))
tool_stall = _tool_scenario("[tool-stall]", ("tool_times_out",))
tool_chain = _tool_scenario("[chain]", ("tool_raises",))


# ---- client-side tools and sessions -------------------------------------------------------------
async def _open_session(c: Client, scenario: str) -> tuple[list[dict[str, Any]], Chat] | None:
    messages = _user(f"[client] weather? {c.unique()}")
    r = await c.chat({"messages": messages, "tools": [WEATHER], "max_tokens": 160, "temperature": 0,
                      "stream": c.rng.random() < 0.5})
    if not _ok_chat(c, scenario, r, EXPECTED_CONTENT["[client]"], finish=("tool_calls",)):
        return None
    if not _expect(c, scenario, bool(r.session_id) and len(r.tool_calls) == 1
                   and r.tool_calls[0]["function"]["name"] == "get_weather", f"no session or call: {r}"):
        return None
    return messages, r


def _history(messages: list[dict[str, Any]], first: Chat, answer: str = "sunny") -> list[dict[str, Any]]:
    result = {"role": "tool", "tool_call_id": first.tool_calls[0]["id"], "content": answer}
    return messages + [first.assistant_message(), result]


async def _close(c: Client, scenario: str, session_id: str, expect: int = 200) -> None:
    if c.rng.random() < 0.5:
        r = await c.send("DELETE", f"/v1/sessions/{session_id}")
    else:
        r = await c.send("POST", f"/v1/sessions/{session_id}/close")
    _expect(c, scenario, r.status_code == expect, f"close gave {r.status_code}, wanted {expect}")


async def session_resume(c: Client) -> None:
    """Tool result sent back on the session: the held request continues; then close or abandon."""
    opened = await _open_session(c, "session_resume")
    if opened is None:
        return
    messages, first = opened
    body = {"messages": _history(messages, first), "tools": [WEATHER], "max_tokens": 160, "temperature": 0,
            "session_id": first.session_id, "stream": c.rng.random() < 0.5}
    if c.rng.random() < 0.2:
        # Two turns on one session at once: one runs, the other gets 409 (or runs after it).
        c.tally.fault("concurrent_resume")
        a, b = await asyncio.gather(c.chat(body), c.chat(body))
        statuses = sorted([a.status, b.status])
        _expect(c, "session_resume", statuses in ([200, 200], [200, 409]), f"concurrent resumes gave {statuses}")
        # If the second ran after the first ended, its (now shorter) history starts a fresh request.
        resumed = a if a.content == RESUMED_CONTENT or b.status != 200 else b
    else:
        resumed = await c.chat(body)
    if not _ok_chat(c, "session_resume", resumed, RESUMED_CONTENT):
        return
    if c.rng.random() < 0.5:
        await _close(c, "session_resume", first.session_id)  # type: ignore[arg-type]
    else:
        c.tally.outcomes["session_left_idle"] += 1  # holds no KV; expires after the TTL


async def session_close(c: Client) -> None:
    """Close while the request is paused holding KV; the session is then gone."""
    opened = await _open_session(c, "session_close")
    if opened is None:
        return
    messages, first = opened
    c.tally.fault("session_closed_while_held")
    await _close(c, "session_close", first.session_id)  # type: ignore[arg-type]
    r = await c.chat({"messages": _history(messages, first), "tools": [WEATHER], "max_tokens": 16,
                      "session_id": first.session_id})
    _expect(c, "session_close", r.status == 404, f"resume after close gave {r.status}")


async def session_abandon(c: Client) -> None:
    """Walk away from a paused request: only the session TTL frees it."""
    if await _open_session(c, "session_abandon") is not None:
        c.tally.fault("session_abandoned")


async def session_edit(c: Client) -> None:
    """Resume with an edited history: the held request is dropped and a fresh one starts."""
    opened = await _open_session(c, "session_edit")
    if opened is None:
        return
    messages, first = opened
    c.tally.fault("history_edited")
    edited = [{"role": "user", "content": messages[0]["content"] + " (edited)"}]
    r = await c.chat({"messages": _history(edited, first), "tools": [WEATHER], "max_tokens": 160,
                      "temperature": 0, "session_id": first.session_id, "stream": c.rng.random() < 0.5})
    if _ok_chat(c, "session_edit", r, EXPECTED_CONTENT["[client]"], finish=("tool_calls",)):
        await _close(c, "session_edit", first.session_id)  # type: ignore[arg-type]


# ---- clients that leave ---------------------------------------------------------------------------
async def disconnect_stream(c: Client) -> None:
    """Hang up mid-stream, during generation or during a server-side tool run."""
    during_tool = c.rng.random() < 0.35
    text = "[tool-stall] hang up" if during_tool else "Talk for a long time"
    c.tally.fault("disconnect_during_tool" if during_tool else "disconnect_mid_stream")
    body = {"messages": _user(f"{text} {c.unique()}"), "max_tokens": LONG_TOKENS, "stream": True,
            "ignore_eos": not during_tool}
    wanted = c.rng.randint(1, 6)
    async with c.http.stream("POST", "/v1/chat/completions", json=body) as r:
        c.record(r.status_code)
        if not _expect(c, "disconnect_stream", r.status_code == 200, f"status {r.status_code}"):
            return
        seen = 0
        async for _ in sse_events(r):
            seen += 1
            if seen >= wanted:
                break


async def client_timeout(c: Client) -> None:
    """A non-streaming request whose client gives up: the server notices the closed connection."""
    c.tally.fault("client_timeout")
    body = {"messages": _user(f"Write an essay {c.unique()}"), "max_tokens": LONG_TOKENS, "ignore_eos": True}
    try:
        r = await c.http.post("/v1/chat/completions", json=body, timeout=c.rng.uniform(0.1, 0.6))
    except httpx.TimeoutException:
        c.tally.http["client_timeout"] += 1
        return
    c.record(r.status_code)
    c.tally.outcomes["finished_before_client_timeout"] += 1
    _expect(c, "client_timeout", r.status_code == 200, f"status {r.status_code}")


async def cancel(c: Client) -> None:
    """The calling task is cancelled (asyncio timeout) at a random point of a request."""
    c.tally.fault("task_cancelled")
    marker = c.rng.choice(["", "[tool-stall] ", "[tool-ok] "])
    body = {"messages": _user(f"{marker}Go on {c.unique()}"), "max_tokens": LONG_TOKENS // 2,
            "stream": c.rng.random() < 0.5}
    started, status = time.monotonic(), []
    try:
        r = await asyncio.wait_for(c.chat(body, got_status=status), timeout=c.rng.uniform(0.05, 0.8))
    except TimeoutError:
        if not status:  # cancelled before the status line: not counted yet
            c.tally.http["client_cancelled"] += 1
        else:
            c.tally.outcomes["cancelled_mid_stream"] += 1
        return
    c.tally.outcomes["finished_before_cancel"] += 1
    _expect(c, "cancel", r.status == 200 and r.error is None,
            f"status {r.status} after {time.monotonic() - started:.2f}s: {r.error}")


# ---- bad input: a 4xx, never a 5xx ----------------------------------------------------------------
_MSG = _user("hi")
MALFORMED: list[tuple[str, str, Any, int]] = [
    # (method, path, body (bytes sent raw), expected status)
    ("POST", "/v1/chat/completions", b"{not json", 400),
    ("POST", "/v1/chat/completions", {"messages": "hi"}, 400),
    ("POST", "/v1/chat/completions", {"messages": []}, 400),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, 400),
    ("POST", "/v1/chat/completions", {"messages": _MSG, "max_tokens": "abc"}, 400),
    ("POST", "/v1/chat/completions", {"messages": _MSG, "max_tokens": -5}, 400),
    ("POST", "/v1/chat/completions", {"messages": _MSG, "temperature": -1.0}, 400),
    ("POST", "/v1/chat/completions", {"messages": _MSG, "n": 17}, 400),
    ("POST", "/v1/chat/completions", {"messages": _MSG, "model": "no-such-model"}, 404),
    ("POST", "/v1/chat/completions", {"messages": _MSG, "tool_choice": "sometimes"}, 400),
    ("POST", "/v1/chat/completions", {"messages": _MSG, "tools": [{"type": "function",
                                                                   "function": {"name": "bad name!"}}]}, 400),
    ("POST", "/v1/chat/completions", {"messages": _MSG, "session_id": "sess-does-not-exist"}, 404),
    ("POST", "/v1/chat/completions", {"messages": _MSG, "stream": "yes"}, 400),
    ("POST", "/v1/chat/completions", [1, 2, 3], 400),
    ("POST", "/v1/completions", {"prompt": 123}, 400),
    ("POST", "/v1/completions", {"prompt": [10 ** 9]}, 400),
    ("POST", "/v1/completions", {"prompt": "word " * 2200, "max_tokens": 4}, 400),
    ("POST", "/v1/completions", {"prompt": "x", "max_tokens": 4, "echo": True}, 400),
    ("POST", "/v1/completions", {"prompt": "x" * 300_000}, 413),
    ("DELETE", "/v1/sessions/sess-unknown", None, 404),
    ("GET", "/v1/models/no-such-model", None, 404),
]


async def malformed(c: Client) -> None:
    method, path, body, status = c.rng.choice(MALFORMED)
    c.tally.fault("malformed_request")
    kwargs: dict[str, Any] = {}
    if isinstance(body, bytes):
        kwargs = {"content": body, "headers": {"content-type": "application/json"}}
    elif body is not None:
        kwargs = {"json": body}
    r = await c.send(method, path, **kwargs)
    _expect(c, "malformed", r.status_code == status, f"{method} {path} {str(body)[:60]}: {r.status_code}, "
                                                      f"wanted {status}: {r.text[:160]}")


# name -> (scenario, weight): the mix leans on tools and faults, not on plain generation.
MIX: dict[str, tuple[Scenario, int]] = {
    "completion": (completion, 12), "chat": (chat, 14),
    "tool_ok": (tool_ok, 9), "tool_fail": (tool_fail, 7), "tool_stall": (tool_stall, 5), "tool_chain": (tool_chain, 4),
    "session_resume": (session_resume, 8), "session_close": (session_close, 4),
    "session_abandon": (session_abandon, 3), "session_edit": (session_edit, 3),
    "disconnect_stream": (disconnect_stream, 9), "client_timeout": (client_timeout, 5), "cancel": (cancel, 7),
    "malformed": (malformed, 10),
}
