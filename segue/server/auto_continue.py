"""Sessions for plain OpenAI clients: continue a held turn when the next request extends it.

An agent built on the OpenAI SDK (or LangGraph, ...) knows nothing of `session_id`: it re-sends the
whole conversation every turn. When auto-continuation is on (ServerConfig.auto_continue), a plain
chat turn (one choice, no session fields) pauses at its end like a session's turn and is held in
an implicit session: one the server opened, whose id the client never sees, that expires after
`auto_continue_ttl_s` idle (a client that does not come back) and gives way first when sessions
run out. The implicit session is indexed by a hash of (tenant, tools, the transcript the client
was shown). A later plain request whose messages start with a held transcript (same tenant, same
tools) checks that session out and continues its paused request through the same path as an
explicit session (chat_start.continue_held), which verifies the transcript message by message,
the tools, and the exact token ids the engine still holds; so the new request's prompt starts
with exactly the held tokens and only the new messages are prefilled. Anything else (history
edited, tools changed, another tenant, the request gone) starts fresh from the full history.

Held turns cost device memory only while a continuation is likely: each is announced to the
scheduler with its expected resume time (the mean gap after which plain clients came back so far),
released into the prefix cache (LLMEngine.abandon: its blocks become evictable but stay findable,
so a late continuation recomputes only what was evicted) after `auto_continue_release_s` idle, and
aborted after `auto_continue_ttl_s`.

Keys are rolling hashes over the normalized messages, so finding the longest held prefix of an
n-message history costs n hashes, not n².
"""
from __future__ import annotations

import asyncio
import hashlib
import json
import logging
from typing import Any

from segue.engine.calls import Abandon, ExpectResume
from segue.engine.protocol import EngineClient
from segue.server.sessions import Session, SessionStore

logger = logging.getLogger(__name__)


def auto_eligible(ctx: Any, body: Any) -> bool:
    """A plain chat request (one choice, no session fields) on a server with auto-continuation."""
    return (ctx.auto is not None and body.session_id is None and not body.open_session
            and body.num_choices == 1)


def _digest(prev: bytes, item: Any) -> bytes:
    return hashlib.sha256(prev + json.dumps(item, sort_keys=True, default=repr).encode()).digest()


def transcript_keys(tenant: str | None, tools: Any, messages: list[tuple]) -> list[str]:
    """keys[k] identifies (tenant, tools, messages[:k]) for k = 0..len(messages)."""
    h = _digest(b"segue-auto-continue", [tenant, tools])
    keys = [h.hex()]
    for m in messages:
        h = _digest(h, m)
        keys.append(h.hex())
    return keys


class AutoContinuation:
    """The index from held transcripts to the implicit sessions that hold them."""

    def __init__(self, store: SessionStore, engine: EngineClient, release_s: float, ttl_s: float) -> None:
        self.store = store
        self.engine = engine
        self.release_s = release_s
        self.ttl_s = ttl_s
        self._by_key: dict[str, str] = {}
        self._key_of: dict[str, str] = {}
        # Held implicit sessions: when they were held, and whether the scheduler knows yet.
        self._held_at: dict[str, float] = {}
        self._announced: set[str] = set()
        self._released: set[str] = set()
        store.on_release.append(self._forget)
        # Mean time after which plain clients continued (exponentially weighted), the expected
        # resume time announced for new holds.
        self.gap_s = release_s / 2
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self._by_key)

    def open(self, tenant: str | None) -> Session | None:
        """A new implicit session for a plain turn that ended held (busy until checked in); None
        when the store is full of sessions that cannot give way (explicit ones, busy ones): a
        plain client never asked for one, so its turn is not held rather than going over
        max_sessions."""
        if len(self.store) >= self.store.max_sessions:
            self.store.expire()
            self.store.drop_implicit(len(self.store) - self.store.max_sessions + 1)
        if len(self.store) >= self.store.max_sessions:
            return None
        return self.store.create(tenant, implicit=True, ttl_s=self.ttl_s)

    def remember(self, session: Session, tools: Any) -> None:
        """Index the session under the transcript it now holds (after the turn's bookkeeping)."""
        self._forget(session)
        key = transcript_keys(session.tenant, tools, session.transcript)[-1]
        old = self._by_key.get(key)
        if old is not None and old != session.session_id:
            # Two identical conversations: the newer one wins, the older is left to expire.
            self._key_of.pop(old, None)
        self._by_key[key] = session.session_id
        self._key_of[session.session_id] = key
        if session.held is not None:
            self._held_at[session.session_id] = self.store.clock()

    def checkout(self, tenant: str | None, tools: Any, history: list[tuple]) -> Session | None:
        """The idle implicit session holding the longest proper prefix of `history`, checked out
        (busy) and unindexed; None when there is none."""
        keys = transcript_keys(tenant, tools, history)
        for k in range(len(history) - 1, 0, -1):
            sid = self._by_key.get(keys[k])
            if sid is None:
                continue
            session = self.store.get_idle(sid)
            if session is None or session.tenant != tenant or session.held is None:
                continue
            now = self.store.clock()
            held_at = self._held_at.get(sid)
            if held_at is not None:
                self.gap_s = 0.8 * self.gap_s + 0.2 * (now - held_at)
            self._forget(session)
            session.busy = True
            session.last_used = now
            self.hits += 1
            return session
        self.misses += 1
        return None

    def _forget(self, session: Session) -> None:
        sid = session.session_id
        key = self._key_of.pop(sid, None)
        if key is not None and self._by_key.get(key) == sid:
            del self._by_key[key]
        self._held_at.pop(sid, None)
        self._announced.discard(sid)
        self._released.discard(sid)

    def _due(self) -> tuple[list[str], list[str]]:
        """Request ids to announce (newly held) and to release (idle past release_s)."""
        now = self.store.clock()
        announce, release = [], []
        for sid, held_at in self._held_at.items():
            session = self.store.get_idle(sid)
            if session is None or session.held is None:
                continue
            rid = session.held.request_id
            if sid not in self._announced:
                self._announced.add(sid)
                announce.append(rid)
            if sid not in self._released and now - held_at > self.release_s:
                self._released.add(sid)
                release.append(rid)
        return announce, release

    async def sweep(self) -> None:
        announce, release = self._due()
        if not announce and not release:
            return
        for rid in announce:
            await self.engine.call(ExpectResume(rid, self.gap_s))
        for rid in release:
            await self.engine.call(Abandon(rid))

    async def run(self, period_s: float) -> None:
        """Background sweep (started by the app's lifespan)."""
        while True:
            await asyncio.sleep(period_s)
            try:
                await self.sweep()
            except Exception:  # a sweep bug must not end sweeping for good
                logger.exception("auto-continuation sweep failed")
