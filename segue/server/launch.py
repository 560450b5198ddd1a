"""`segue serve`: load the engine, then run the OpenAI-compatible app under uvicorn."""
from __future__ import annotations

import argparse
import logging

from segue.config import EngineConfig

logger = logging.getLogger(__name__)

# Seconds uvicorn lets open responses finish after a shutdown signal before cancelling them
# (which aborts their engine requests); long agent streams must not hold a restart hostage.
GRACEFUL_SHUTDOWN_S = 10


def run_server(config: EngineConfig, args: argparse.Namespace) -> int:
    import uvicorn

    from segue.cluster import DEFAULT_ENGINE_RESTARTS, build_engine
    from segue.server.app import create_app
    from segue.server.auth import resolve_api_keys
    from segue.server.config import ServerConfigError, load_server_config

    host = getattr(args, "host", None) or "127.0.0.1"
    port = getattr(args, "port", None) or 8000
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
    server = uvicorn.Server(uvicorn.Config(
        app, host=host, port=port, log_level=str(getattr(args, "log_level", "info")).lower(),
        lifespan="on", timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S))
    try:
        server.run()
    except SystemExit as e:  # uvicorn exits this way when it cannot bind the port
        return int(e.code or 1)
    except KeyboardInterrupt:
        # uvicorn re-raises the Ctrl-C it handled once the graceful shutdown is done; that is a
        # normal stop, not a crash worth a traceback.
        return 0
    return 0 if server.started else 1
