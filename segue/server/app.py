"""The FastAPI application for one engine.

Routes live in routes_*.py; what they share (engine, settings, tools, sessions, limits, metrics)
is the ServingContext in app.state.serving. Bodies are parsed as JSON whatever their content type,
because `curl -d` labels JSON as form data. Middleware order, outermost first: metrics (so 401,
413 and 429 are counted too), body size limit, API keys.
"""
from __future__ import annotations

import asyncio
import contextlib
from typing import AsyncIterator

from fastapi import FastAPI

from segue.engine.protocol import EngineClient
from segue.server.auth import APIKeyMiddleware
from segue.server.config import ServerConfig
from segue.server.context import ServingContext
from segue.server.errors import install_error_handlers
from segue.server.limits import BodySizeLimitMiddleware
from segue.server.metrics import HTTPMetricsMiddleware
from segue.server.openapi import install_body_schemas
from segue.server.routes_chat import router as chat_router
from segue.server.routes_completions import router as completions_router
from segue.server.routes_misc import router as misc_router
from segue.server.routes_programs import router as programs_router
from segue.tools.registry import ToolRegistry

# The expiry sweep runs this often at most (and at least every tenth of the TTL).
MAX_SWEEP_PERIOD_S = 5.0


def create_app(engine: EngineClient, api_keys: list[str] | None = None, shutdown_engine: bool = False,
               config: ServerConfig | None = None, tools: ToolRegistry | None = None) -> FastAPI:
    """The server for one engine. With shutdown_engine the app owns the engine and stops it when
    the server shuts down (launch.py); tests share one engine between apps and leave it running.
    `api_keys` adds to config.api_keys; `tools` are the operator's server-side tools."""
    config = (config or ServerConfig()).validate()
    keys = list(dict.fromkeys(list(api_keys or []) + config.api_keys))
    ctx = ServingContext(engine, config, tools or ToolRegistry())

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        period = min(MAX_SWEEP_PERIOD_S, config.session_ttl_s / 10,
                     config.auto_continue_ttl_s / 10 if config.auto_continue else MAX_SWEEP_PERIOD_S)
        sweeper = asyncio.create_task(ctx.sessions.run_expiry(period))
        auto = (asyncio.create_task(ctx.auto.run(min(1.0, config.auto_continue_release_s / 4)))
                if ctx.auto is not None else None)
        try:
            yield
        finally:
            sweeper.cancel()
            if auto is not None:
                auto.cancel()
            # Held sessions pin engine requests; release them before (or without) stopping the engine.
            ctx.sessions.close_all()
            await ctx.runner.aclose()
            if shutdown_engine:
                await engine.shutdown()

    app = FastAPI(title="Segue", lifespan=lifespan)
    app.state.serving = ctx
    install_error_handlers(app)
    if keys:
        app.add_middleware(APIKeyMiddleware, api_keys=keys)
    app.add_middleware(BodySizeLimitMiddleware, max_bytes=config.max_body_bytes)
    app.add_middleware(HTTPMetricsMiddleware, metrics=ctx.metrics)
    for router in (misc_router, completions_router, chat_router, programs_router):
        app.include_router(router)
    install_body_schemas(app)
    return app
