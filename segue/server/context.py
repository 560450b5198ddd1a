"""Everything the routes share for one engine: the engine, settings, tools, sessions, limits, metrics."""
from __future__ import annotations

import asyncio
import inspect
import time
from dataclasses import dataclass, field
from typing import Any, Callable, TypeVar

from fastapi import Request

from segue.async_engine import AsyncLLMEngine
from segue.server.auto_continue import AutoContinuation
from segue.server.config import ServerConfig
from segue.server.errors import APIError
from segue.server.limits import ConcurrencyLimiter
from segue.server.metrics import ServerMetrics
from segue.server.sessions import SessionStore
from segue.server.templating import ChatRenderer
from segue.tools.registry import ToolRegistry
from segue.tools.runner import ToolRunner

T = TypeVar("T")


@dataclass
class ServingContext:
    engine: AsyncLLMEngine
    config: ServerConfig
    tools: ToolRegistry
    model_name: str = ""
    max_model_len: int = 0
    created: int = field(default_factory=lambda: int(time.time()))

    def __post_init__(self) -> None:
        llm = self.engine.engine
        self.model_name = self.model_name or llm.model_name
        self.max_model_len = self.max_model_len or llm.max_model_len
        # The runner keeps its own duration stats: the engine's come from its interception path
        # (call to resume) and must not count each call twice.
        self.runner = ToolRunner(self.tools)
        for spec in self.tools.specs():
            llm.tool_stats.set_hint(spec.name, spec.expected_seconds)
        # The model's recommended sampling settings, for what a client leaves out.
        self.generation_defaults: dict[str, Any] = dict(llm.generation_defaults)
        self.renderer = ChatRenderer(llm.apply_chat_template, llm.chat_template)
        self.sessions = SessionStore(self.engine.abort, self.config.session_ttl_s, self.config.max_sessions,
                                     forget_program=self.engine.forget_program)
        self.auto = (AutoContinuation(self.sessions, self.engine, self.config.auto_continue_release_s,
                                      self.config.auto_continue_ttl_s) if self.config.auto_continue else None)
        self.limiter = ConcurrencyLimiter(self.config.max_concurrent_requests)
        self.metrics = ServerMetrics(self)
        # Per-tenant prefix-cache salts need the engine's per-request hook (see README); until it
        # exists, isolation is off rather than a crash.
        self.engine_takes_salt = "cache_salt" in inspect.signature(llm.make_request).parameters

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise APIError(404, f"the model {model!r} does not exist; this server serves {self.model_name!r}",
                           param="model", code="model_not_found")

    def generate_hints(self, tenant_salt: str | None) -> dict[str, Any]:
        if tenant_salt is not None and self.engine_takes_salt and self.config.prefix_cache_isolation == "per_key":
            return {"cache_salt": tenant_salt}
        return {}

    async def in_thread(self, fn: Callable[..., T], *args: Any) -> T:
        # Tokenizers and chat templates are slow enough to stall every other stream on the loop.
        return await asyncio.get_running_loop().run_in_executor(None, fn, *args)

    async def tokenize(self, prompt: str | list[int]) -> list[int]:
        return list(prompt) if isinstance(prompt, list) else await self.in_thread(self.engine.engine.encode, prompt)


def serving(request: Request) -> ServingContext:
    return request.app.state.serving
