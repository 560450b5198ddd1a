"""`segue serve`: load the engine, then run the OpenAI-compatible app under uvicorn."""
from __future__ import annotations

import argparse
import logging
from typing import TYPE_CHECKING, Any

from segue.config import EngineConfig

if TYPE_CHECKING:
    import uvicorn

logger = logging.getLogger(__name__)

# Seconds uvicorn lets open responses finish after a shutdown signal before cancelling them
# (which aborts their engine requests); long agent streams must not hold a restart hostage.
GRACEFUL_SHUTDOWN_S = 10
# Seconds an idle connection stays open. An agent's next request comes after its tool ran; if the
# server closes the connection just as the client reuses it, the request fails with a connection
# error (uvicorn's default, 5 s, is httpx's and so the openai SDK's expiry too). Above what clients
# keep idle connections for (httpx 5 s, Node 4 s, aiohttp 15 s, Go 90 s), the client always gives
# up on a connection first. An idle connection costs a socket, nothing in the engine.
DEFAULT_KEEP_ALIVE_S = 120


def uvicorn_config(app: Any, args: argparse.Namespace) -> "uvicorn.Config":
    """uvicorn's settings for `segue serve`."""
    import uvicorn

    return uvicorn.Config(
        app, host=getattr(args, "host", None) or "127.0.0.1", port=getattr(args, "port", None) or 8000,
        log_level=str(getattr(args, "log_level", "info")).lower(), lifespan="on",
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
        timeout_keep_alive=getattr(args, "timeout_keep_alive", None) or DEFAULT_KEEP_ALIVE_S)


def run_server(config: EngineConfig, args: argparse.Namespace) -> int:
    import uvicorn

    from segue.cluster import DEFAULT_ENGINE_RESTARTS, build_engine
    from segue.server.app import create_app
    from segue.server.auth import resolve_api_keys
    from segue.server.config import ServerConfigError, load_server_config

    host = getattr(args, "host", None) or "127.0.0.1"
    port = getattr(args, "port", None) or 8000
    keep_alive = getattr(args, "timeout_keep_alive", None)
    if keep_alive is not None and keep_alive < 1:
        logger.error("--timeout-keep-alive must be at least 1 second, got %d", keep_alive)
        return 2
    try:
        server_config, tools = load_server_config(getattr(args, "config", None))
    except ServerConfigError as e:
        logger.error("%s", e)
        return 2
    server_config.api_keys = resolve_api_keys(getattr(args, "api_key", None), server_config.api_keys)
    # Load before binding the port, so a bad --model fails fast and nothing half-starts.
    engines = getattr(args, "engines", None) or 1
    if engines < 1:
        logger.error("--engines must be at least 1, got %d", engines)
        return 2
    restarts = getattr(args, "engine_restarts", None)
    restarts = DEFAULT_ENGINE_RESTARTS if restarts is None else restarts
    if restarts < 0:
        logger.error("--engine-restarts must be at least 0, got %d", restarts)
        return 2
    # --engines N > 1: N engine replicas as Ray actors behind an affinity router (segue/cluster).
    engine = build_engine(config, engines, router=getattr(args, "router", None) or "affinity",
                          max_restarts=restarts)
    # An EnginePool presents AsyncLLMEngine's interface (the two share no declared Protocol yet).
    app = create_app(engine, shutdown_engine=True, config=server_config, tools=tools)
    logger.info("serving %r (context %d tokens, %d engine%s) on http://%s:%d/v1%s; server-side tools: %s",
                engine.model_info().model_name, engine.model_info().max_model_len, engines,
                "s" if engines > 1 else "", host, port,
                " with API keys" if server_config.api_keys else "", ", ".join(tools.names()) or "none")
    if not server_config.api_keys and host not in ("127.0.0.1", "localhost", "::1"):
        logger.warning("listening on %s without API keys: anyone who can reach it can use it", host)
    server = uvicorn.Server(uvicorn_config(app, args))
    try:
        server.run()
    except SystemExit as e:  # uvicorn exits this way when it cannot bind the port
        return int(e.code or 1)
    except KeyboardInterrupt:
        # uvicorn re-raises the Ctrl-C it handled once the graceful shutdown is done; that is a
        # normal stop, not a crash worth a traceback.
        return 0
    return 0 if server.started else 1
