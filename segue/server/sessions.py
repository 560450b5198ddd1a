"""Sessions: conversations whose paused request the engine keeps between client turns.

A response that ends on client-side tool calls, or a session's turn that ends normally or on
max_tokens (a human turn is next; the request pauses at its stop token or last token instead of
finishing, see pause_on_stop and pause_on_length), leaves its request paused in the engine
(detached from the finished HTTP stream); the session remembers what the client saw (`transcript`)
and what the model holds (`context` + `segment`), so the client's next request, which repeats the
whole history as OpenAI clients do, can be checked against the transcript and only the new
messages fed to the engine. While paused, the request's KV
follows the engine's interception policy (preserved, swapped or discarded), so a held session
costs little device memory; the idle expiry aborts it.

A turn that ends on the context window is not held (nothing would fit after it). One whose held
tokens may differ from what the template renders for its text (cut off by max_tokens inside a
character, a stop string the client never saw) is held too: the next turn renders the whole
history and keeps the longest common prefix of the two token lists, recomputing only the rest.

Sessions belong to the tenant (API key) that made them; any other tenant gets the same 404 as for
an unknown id, so ids cannot be probed.
"""
from __future__ import annotations

import asyncio
import logging
import secrets
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from segue.program.registry import scoped_program_id
from segue.server.errors import APIError
from segue.tools.parser import ToolCallParser

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class OutputMark:
    """How far a request's output had got when its turn began or paused: the next turn's new text
    and tokens are counted from here (zero for a fresh request)."""
    text_len: int = 0
    num_generated: int = 0


@dataclass(frozen=True)
class HeldConversation:
    """What the model holds of the conversation at a pause, to render the next turn's messages after."""
    # Internal conversation before `segment` (injected tool messages included).
    context: list[dict[str, Any]]
    # Assistant text generated since the last resume (with any prefilled call start).
    segment: str
    # The tools the conversation was rendered with: a next turn with other tools starts fresh.
    tools: list[dict[str, Any]]
    # Results of server-side calls made in the same pause, appended before the client's.
    server_results: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class HeldRequest:
    """A paused engine request and what is needed to continue it."""
    request_id: str
    # Token ids the engine holds for it (prompt + output), to verify it before continuing.
    token_ids: list[int]
    conversation: HeldConversation
    # Where the output stood at the pause: where the next turn's new text and tokens start.
    output: OutputMark
    # The turn's parser (of the request's tool-call format), for splitting the next turn's text.
    parser: ToolCallParser | None
    # Text of the token held after `segment` when the turn paused at its stop (the end-of-turn
    # token): the next turn's rendered continuation starts with it, and it is not appended again.
    end_text: str = ""
    # The turn ended elsewhere (cut off by max_tokens, a stop string, a stop token the template
    # does not continue with): its tokens may not be what rendering the history gives (a cut
    # inside a character, a special token the text skips, text the client never saw). The next
    # turn renders the whole history, keeps the longest prefix it shares with `token_ids` and
    # replaces the rest, so it holds exactly a fresh request's tokens.
    rerender: bool = False


@dataclass
class Session:
    session_id: str
    tenant: str | None
    created: float
    last_used: float
    # Normalized client-visible messages (templating.normalize) the next request must start with.
    transcript: list[tuple] = field(default_factory=list)
    held: HeldRequest | None = None
    # The engine request of the turn in progress, so closing a busy session can abort it.
    active_request_id: str | None = None
    busy: bool = False
    closed: bool = False
    # Opened by the server for a plain client's held turn (auto_continue.py), not by the client:
    # its id is never shown, it expires after its own short TTL and gives way at capacity.
    implicit: bool = False
    ttl_s: float | None = None


class SessionStore:
    def __init__(self, abort: Callable[[str], None], ttl_s: float, max_sessions: int,
                 clock: Callable[[], float] = time.monotonic,
                 forget_program: Callable[[str], None] | None = None) -> None:
        self._abort = abort
        # Sessions are programs by default (their id is the program id): closing one unbinds it
        # from its engine replica.
        self._forget_program = forget_program
        self.ttl_s = ttl_s
        self.max_sessions = max_sessions
        self.clock = clock
        self._sessions: dict[str, Session] = {}
        # Called with every session that goes away (auto_continue.py drops it from its index).
        self.on_release: list[Callable[[Session], None]] = []

    def __len__(self) -> int:
        return len(self._sessions)

    def counts(self) -> dict[str, int]:
        held = sum(1 for s in self._sessions.values() if s.held is not None)
        return {"held": held, "idle": len(self._sessions) - held}

    def check_capacity(self) -> None:
        if len(self._sessions) >= self.max_sessions:
            self.expire()
        if len(self._sessions) >= self.max_sessions:
            self.drop_implicit(len(self._sessions) - self.max_sessions + 1)
        if len(self._sessions) >= self.max_sessions:
            raise APIError(429, f"too many open sessions ({self.max_sessions}); close some "
                                "(DELETE /v1/sessions/{id}) or wait for idle ones to expire",
                           type="rate_limit_error", code="too_many_sessions", headers={"Retry-After": "1"})

    def create(self, tenant: str | None, implicit: bool = False, ttl_s: float | None = None) -> Session:
        now = self.clock()
        session = Session("sess-" + secrets.token_hex(16), tenant, now, now, busy=True, implicit=implicit,
                          ttl_s=ttl_s)
        self._sessions[session.session_id] = session
        return session

    def _get(self, session_id: str, tenant: str | None) -> Session:
        session = self._sessions.get(session_id)
        # Another tenant's session looks exactly like a missing one.
        if session is None or session.tenant != tenant:
            raise APIError(404, f"session {session_id!r} does not exist (closed, expired or never created)",
                           param="session_id", code="session_not_found")
        return session

    def checkout(self, session_id: str, tenant: str | None) -> Session:
        """Take a session for one turn; a session serves one request at a time (409 otherwise)."""
        session = self._get(session_id, tenant)
        if session.busy:
            raise APIError(409, f"session {session_id!r} is busy with another request", param="session_id",
                           code="session_busy")
        session.busy = True
        session.last_used = self.clock()
        return session

    def checkin(self, session: Session) -> None:
        session.busy = False
        session.active_request_id = None
        session.last_used = self.clock()
        if session.closed:  # closed while its turn ran: the turn's request was aborted then
            self._release(session)
        elif session.implicit and session.held is None:
            # Nothing to continue, and nobody knows the id: keep no empty shell around.
            session.closed = True
            self._release(session)

    def take_held(self, session: Session) -> HeldRequest | None:
        held, session.held = session.held, None
        return held

    def hold(self, session: Session, held: HeldRequest) -> None:
        """Keep a paused request for the session's next turn (or drop it if the session closed)."""
        if session.closed:
            self._abort(held.request_id)
        else:
            session.held = held

    def close(self, session_id: str, tenant: str | None) -> None:
        session = self._get(session_id, tenant)
        session.closed = True
        if session.active_request_id is not None:
            self._abort(session.active_request_id)
        self._release(session)

    def get_idle(self, session_id: str) -> Session | None:
        """The session if it exists and is idle (for the server's own lookups, no tenant check)."""
        session = self._sessions.get(session_id)
        return session if session is not None and not session.busy and not session.closed else None

    def drop_implicit(self, count: int) -> int:
        """Close up to `count` idle implicit sessions, least recently used first."""
        idle = sorted((s for s in self._sessions.values() if s.implicit and not s.busy), key=lambda s: s.last_used)
        for session in idle[:count]:
            session.closed = True
            self._release(session)
        return min(count, len(idle))

    def _release(self, session: Session) -> None:
        self._sessions.pop(session.session_id, None)
        for hook in self.on_release:
            hook(session)
        if self._forget_program is not None:
            self._forget_program(scoped_program_id(session.tenant, session.session_id))
        held = self.take_held(session)
        if held is not None:
            self._abort(held.request_id)

    def expire(self, now: float | None = None) -> int:
        """Close sessions idle for longer than the TTL; returns how many."""
        now = self.clock() if now is None else now
        stale = [s for s in self._sessions.values()
                 if not s.busy and now - s.last_used > (s.ttl_s if s.ttl_s is not None else self.ttl_s)]
        for session in stale:
            session.closed = True
            self._release(session)
        if stale:
            logger.info("expired %d idle session(s)", len(stale))
        return len(stale)

    def close_all(self) -> None:
        for session in list(self._sessions.values()):
            session.closed = True
            self._release(session)

    async def run_expiry(self, period_s: float) -> None:
        """Background sweep (started by the app's lifespan)."""
        while True:
            await asyncio.sleep(period_s)
            try:
                self.expire()
            except Exception:  # a sweep bug must not end sweeping for good
                logger.exception("session expiry failed")
