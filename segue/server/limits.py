"""Admission limits: concurrent requests (429), request bodies (413) and request deadlines (504).

Refusing at the door is what keeps an overloaded server useful: a queue without bound turns every
request into a timeout, while a prompt 429 lets clients back off or go elsewhere.
"""
from __future__ import annotations

import asyncio
import time
from typing import AsyncIterator, Awaitable, TypeVar

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from segue.server.errors import APIError, error_response

T = TypeVar("T")


class ConcurrencyLimiter:
    """Counts generation requests from admission until their response ends (the event loop is
    single-threaded, so a plain counter is exact)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.in_flight = 0
        self.rejected = 0

    def acquire(self, count: int = 1) -> "Slot":
        """`count` engine requests at once (a request with n choices runs n), all or none."""
        if count > self.limit:  # would never fit: retrying cannot help
            raise APIError(400, f"n={count} exceeds this server's limit of {self.limit} concurrent requests",
                           param="n")
        if self.in_flight + count > self.limit:
            self.rejected += 1
            raise APIError(429, f"the server is at its limit of {self.limit} concurrent requests; retry shortly",
                           type="rate_limit_error", code="too_many_requests", headers={"Retry-After": "1"})
        self.in_flight += count
        return Slot(self, count)


class Slot:
    def __init__(self, limiter: ConcurrencyLimiter, count: int = 1) -> None:
        self._limiter: ConcurrencyLimiter | None = limiter
        self.count = count

    def release(self) -> None:
        # Idempotent: both the response's end and error paths release.
        if self._limiter is not None:
            self._limiter.in_flight -= self.count
            self._limiter = None


class Deadline:
    """A request's time limit, applied to every wait (engine outputs, tool runs) along the way."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.at = time.monotonic() + timeout_s

    def remaining(self) -> float:
        return max(0.0, self.at - time.monotonic())

    def error(self) -> APIError:
        return APIError(504, f"the request did not finish within {self.timeout_s:g} s and was aborted",
                        code="request_timeout")

    async def run(self, aw: Awaitable[T]) -> T:
        # asyncio.timeout, not wait_for: on Python 3.11 wait_for runs `aw` in a task of its own and
        # drops a cancellation that arrives as that task completes (every token, for a stream), so
        # a response cancelled for a client that left kept generating to the end (~1 in 6 runs of
        # test_non_stream_disconnect_frees_kv).
        try:
            async with asyncio.timeout(self.remaining()):
                return await aw
        except TimeoutError:
            raise self.error() from None

    async def next(self, it: AsyncIterator[T]) -> T:
        return await self.run(it.__anext__())


class BodySizeLimitMiddleware:
    """413 for bodies over the limit, by Content-Length up front or by counting a chunked upload
    (plain ASGI so streaming responses are untouched)."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    def _too_large(self) -> APIError:
        return APIError(413, f"the request body exceeds {self.max_bytes} bytes", code="request_too_large")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        for name, value in scope.get("headers", []):
            if name == b"content-length":
                try:
                    too_large = int(value) > self.max_bytes
                except ValueError:
                    too_large = False
                if too_large:
                    await error_response(self._too_large())(scope, receive, send)
                    return
        seen = 0

        async def counting_receive() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    # Raised inside the route's body read; the APIError handler renders it.
                    raise self._too_large()
            return message

        await self.app(scope, counting_receive, send)
