"""Running tool calls: validation, concurrency limits, timeouts, errors as results, timing.

Every outcome is a ToolResult. Whatever the model asked for and whatever the tool did (raise, hang,
return megabytes), the engine gets text to append and the request can resume; nothing here lets a
tool failure escape into the serving loop, and no traceback reaches the model.
"""
from __future__ import annotations

import asyncio
import contextvars
import inspect
import json
import threading
import time
from typing import TYPE_CHECKING, Any, Callable, Sequence

import jsonschema
import jsonschema.exceptions
import jsonschema.validators

from segue.tools.registry import RegisteredTool, ToolRegistry
from segue.tools.spec import ToolCall, ToolKind, ToolResult, ToolSpec
from segue.tools.stats import DurationStats

if TYPE_CHECKING:  # httpx is only needed once an HTTP tool actually runs
    import httpx


def truncate(content: str, limit: int) -> tuple[str, bool]:
    """Cut content to at most `limit` characters, marker included, saying how much was dropped."""
    if len(content) <= limit:
        return content, False
    # Size the marker for the largest possible count first, so the final text never exceeds limit.
    keep = max(0, limit - len(f"…[truncated {len(content)} chars]"))
    return content[:keep] + f"…[truncated {len(content) - keep} chars]", True


def to_text(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, (bytes, bytearray)):
        return bytes(value).decode("utf-8", errors="replace")
    if isinstance(value, (dict, list, tuple, int, float, bool)):
        return json.dumps(value, ensure_ascii=False, default=str)
    return str(value)


class _ToolFailed(Exception):
    """A tool outcome that is already a model-readable error message (e.g. HTTP 500)."""


class ToolRunner:
    """Runs calls against a registry's tools, recording every execution's duration in `stats`."""

    def __init__(self, registry: ToolRegistry, stats: DurationStats | None = None, *,
                 http_client: "httpx.AsyncClient | None" = None) -> None:
        self.registry = registry
        self.stats = stats if stats is not None else DurationStats()
        self._own_client = http_client is None
        self._client = http_client
        self._client_loop: asyncio.AbstractEventLoop | None = None
        # Semaphores bind to the event loop that first waits on them; keep one per (tool, loop).
        self._semaphores: dict[str, tuple[asyncio.AbstractEventLoop, int, asyncio.Semaphore]] = {}
        self._validators: dict[str, tuple[ToolSpec, Any]] = {}
        self._lock = threading.Lock()
        for spec in registry.specs():
            self.stats.set_hint(spec.name, spec.expected_seconds)

    def expected_seconds(self, name: str) -> float | None:
        """Predicted duration of the next call to `name`: observed mean, else the spec's hint."""
        spec = self.registry.get(name)
        return self.stats.expected(name, spec.expected_seconds if spec else None)

    async def run_all(self, calls: Sequence[ToolCall]) -> list[ToolResult]:
        """Run calls concurrently (a model's parallel calls); results in the calls' order."""
        return list(await asyncio.gather(*(self.run(c) for c in calls)))

    async def run(self, call: ToolCall) -> ToolResult:
        t0 = time.perf_counter()
        if call.error is not None:
            return self._error(call, t0, f"could not parse the tool call: {call.error}")
        entry = self.registry.entry(call.name)
        if entry is None:
            # Never recorded in stats: names from model output must not grow any table.
            available = ", ".join(self.registry.names()) or "none"
            return self._error(call, t0, f"unknown tool {call.name!r}; available tools: {available}")
        spec = entry.spec
        problem = self._validate(spec, call.arguments)
        if problem is not None:
            return self._error(call, t0, f"invalid arguments for tool {spec.name!r}: {problem}", spec)

        # The timeout covers queueing for a concurrency slot too: it bounds how long the paused
        # request waits, which is what the scheduler and the user care about.
        try:
            value = await asyncio.wait_for(self._execute(entry, call.arguments), spec.timeout_s)
        except TimeoutError:  # only wait_for's: _execute wraps the tool's own exceptions
            return self._finish(call, spec, t0, f"error: tool {spec.name!r} timed out after {spec.timeout_s:g} s",
                                is_error=True)
        except _ToolFailed as exc:
            return self._finish(call, spec, t0, f"error: tool {spec.name!r} {exc}", is_error=True)
        return self._finish(call, spec, t0, value, is_error=False)

    # ---- execution -----------------------------------------------------------------------
    async def _execute(self, entry: RegisteredTool, arguments: dict[str, Any]) -> str:
        try:
            # Converted here so that even a result whose __str__ raises becomes an error result.
            return to_text(await self._invoke(entry, arguments))
        except _ToolFailed:
            raise
        except Exception as exc:
            # Wrapped so that a TimeoutError the tool raises itself is not mistaken for ours.
            raise _ToolFailed(f"failed: {_describe(exc)}") from exc

    async def _invoke(self, entry: RegisteredTool, arguments: dict[str, Any]) -> Any:
        async with self._semaphore(entry.spec):
            if entry.spec.kind is ToolKind.HTTP:
                return await self._post(entry.spec, arguments)
            fn = entry.fn
            assert fn is not None  # register() guarantees a callable for python tools
            if inspect.iscoroutinefunction(fn):
                value = await fn(**arguments)
            else:
                value = await _run_in_thread(fn, arguments, entry.spec.name)
            if inspect.isawaitable(value):  # e.g. a sync wrapper or partial returning a coroutine
                value = await value
            return value

    async def _post(self, spec: ToolSpec, arguments: dict[str, Any]) -> str:
        response = await self._http().post(spec.target, json=arguments, timeout=spec.timeout_s)
        if not 200 <= response.status_code < 300:
            body = response.text.strip()
            raise _ToolFailed(f"returned HTTP {response.status_code}" + (f": {body}" if body else ""))
        return response.text

    def _http(self) -> "httpx.AsyncClient":
        import httpx

        loop = asyncio.get_running_loop()
        # An AsyncClient's connection pool belongs to one event loop; a caller-supplied client is
        # the caller's business, our own is remade when a new loop comes along.
        if self._client is None or (self._own_client and self._client_loop is not loop):
            self._client = httpx.AsyncClient()
            self._client_loop = loop
        return self._client

    async def aclose(self) -> None:
        """Close the HTTP client this runner made (call from the loop that used it)."""
        if self._own_client and self._client is not None:
            client, self._client = self._client, None
            await client.aclose()

    async def __aenter__(self) -> "ToolRunner":
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    def _semaphore(self, spec: ToolSpec) -> asyncio.Semaphore:
        loop = asyncio.get_running_loop()
        with self._lock:
            held = self._semaphores.get(spec.name)
            if held is None or held[0] is not loop or held[1] != spec.max_concurrency:
                held = (loop, spec.max_concurrency, asyncio.Semaphore(spec.max_concurrency))
                self._semaphores[spec.name] = held
            return held[2]

    def _validate(self, spec: ToolSpec, arguments: Any) -> str | None:
        if not isinstance(arguments, dict):
            return f"arguments must be a JSON object, got {type(arguments).__name__}"
        with self._lock:
            cached = self._validators.get(spec.name)
            if cached is None or cached[0] is not spec:  # re-registered: schema may differ
                cls = jsonschema.validators.validator_for(spec.parameters, default=jsonschema.Draft202012Validator)
                cached = (spec, cls(spec.parameters))
                self._validators[spec.name] = cached
        error = jsonschema.exceptions.best_match(cached[1].iter_errors(arguments))
        if error is None:
            return None
        where = "/".join(str(p) for p in error.absolute_path)
        return f"{error.message}" + (f" (at {where})" if where else "")

    # ---- results -------------------------------------------------------------------------
    def _finish(self, call: ToolCall, spec: ToolSpec, t0: float, content: str, *, is_error: bool) -> ToolResult:
        duration = time.perf_counter() - t0
        # Failures and timeouts count too: the scheduler must know how long a pause really lasts.
        self.stats.observe(spec.name, duration)
        content, truncated = truncate(content, spec.max_result_chars)
        return ToolResult(call.id, spec.name, content, is_error, duration, truncated)

    def _error(self, call: ToolCall, t0: float, message: str, spec: ToolSpec | None = None) -> ToolResult:
        # The tool never ran (bad call): answered at once and kept out of the duration stats.
        content, truncated = truncate("error: " + message, spec.max_result_chars if spec else 16384)
        return ToolResult(call.id, call.name, content, True, time.perf_counter() - t0, truncated)


def _describe(exc: BaseException) -> str:
    message = str(exc)
    return f"{type(exc).__name__}: {message}" if message else type(exc).__name__


async def _run_in_thread(fn: Callable[..., Any], arguments: dict[str, Any], name: str) -> Any:
    """Run a sync tool on its own daemon thread.

    Not asyncio.to_thread: Python cannot kill a thread, so a hung tool keeps its thread after the
    timeout. In the default executor (a handful of workers on a small machine) a few hangs would
    starve every other sync tool, and its non-daemon workers would block interpreter exit.
    """
    loop = asyncio.get_running_loop()
    future: asyncio.Future[Any] = loop.create_future()
    ctx = contextvars.copy_context()

    def deliver(setter: Callable[[Any], None], value: Any) -> None:
        if not future.done():  # already cancelled by a timeout: drop the late outcome
            setter(value)

    def target() -> None:
        try:
            outcome: tuple[Callable[[Any], None], Any] = (future.set_result, ctx.run(fn, **arguments))
        except Exception as exc:
            outcome = (future.set_exception, exc)
        except BaseException as exc:  # SystemExit and the like must not travel into the event loop
            outcome = (future.set_exception, RuntimeError(f"tool raised {type(exc).__name__}"))
        try:
            loop.call_soon_threadsafe(deliver, *outcome)
        except RuntimeError:  # the loop closed while the tool ran; nobody is waiting any more
            pass

    threading.Thread(target=target, name=f"segue-tool-{name}", daemon=True).start()
    return await future
