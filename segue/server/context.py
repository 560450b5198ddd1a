"""Everything the routes share for one engine: the engine, settings, tools, sessions, limits, metrics."""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any, Callable, TypeVar

from fastapi import Request

from segue.engine.calls import Abort
from segue.engine.protocol import EngineClient
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
    engine: EngineClient
    config: ServerConfig
    tools: ToolRegistry
    model_name: str = ""
    max_model_len: int = 0
    created: int = field(default_factory=lambda: int(time.time()))

    def __post_init__(self) -> None:
        info = self.engine.model_info()
        self.model_name = self.model_name or info.model_name
        self.max_model_len = self.max_model_len or info.max_model_len
        # The runner keeps its own duration stats: the engine's come from its interception path
        # (call to resume) and must not count each call twice.
        self.runner = ToolRunner(self.tools)
        for spec in self.tools.specs():
            self.engine.set_tool_hint(spec.name, spec.expected_seconds)
        # The model's recommended sampling settings, for what a client leaves out.
        self.generation_defaults: dict[str, Any] = dict(info.generation_defaults)
        self.renderer = ChatRenderer(self.engine.apply_chat_template, info.chat_template)

        def abort(request_id: str) -> None:
            self.engine.call(Abort(request_id))  # answered at once: nothing to await
        self.sessions = SessionStore(abort, self.config.session_ttl_s, self.config.max_sessions,
                                     forget_program=self.engine.forget_program)
        self.auto = (AutoContinuation(self.sessions, self.engine, self.config.auto_continue_release_s,
                                      self.config.auto_continue_ttl_s) if self.config.auto_continue else None)
        self.limiter = ConcurrencyLimiter(self.config.max_concurrent_requests)
        self.metrics = ServerMetrics(self)

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise APIError(404, f"the model {model!r} does not exist; this server serves {self.model_name!r}",
                           param="model", code="model_not_found")

    def prefix_cache_salt(self, tenant_salt: str | None) -> str | None:
        """The prefix-cache salt of a tenant's requests: its own under per-key isolation, else
        none (every tenant shares the cache)."""
        if tenant_salt is not None and self.config.prefix_cache_isolation == "per_key":
            return tenant_salt
        return None

    async def in_thread(self, fn: Callable[..., T], *args: Any) -> T:
        # Tokenizers and chat templates are slow enough to stall every other stream on the loop.
        return await asyncio.get_running_loop().run_in_executor(None, fn, *args)

    async def tokenize(self, prompt: str | list[int]) -> list[int]:
        return list(prompt) if isinstance(prompt, list) else await self.in_thread(self.engine.encode, prompt)


def serving(request: Request) -> ServingContext:
    return request.app.state.serving
