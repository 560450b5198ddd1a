"""`segue serve`: load the engine, then run the OpenAI-compatible app under uvicorn."""
from __future__ import annotations

import argparse
import logging
import os

from segue.config import EngineConfig

logger = logging.getLogger(__name__)

# Seconds uvicorn lets open responses finish after a shutdown signal before cancelling them
# (which aborts their engine requests); long agent streams must not hold a restart hostage.
GRACEFUL_SHUTDOWN_S = 10


def resolve_api_keys(args: argparse.Namespace) -> list[str]:
    """--api-key (repeatable) wins; otherwise SEGUE_API_KEYS, comma separated. Empty: no auth."""
    keys = list(getattr(args, "api_key", None) or [])
    if not keys:
        keys = os.environ.get("SEGUE_API_KEYS", "").split(",")
    return [k.strip() for k in keys if k and k.strip()]


def run_server(config: EngineConfig, args: argparse.Namespace) -> int:
    import uvicorn

    from segue.async_engine import AsyncLLMEngine
    from segue.server.app import create_app

    host = getattr(args, "host", None) or "127.0.0.1"
    port = getattr(args, "port", None) or 8000
    api_keys = resolve_api_keys(args)
    # Load before binding the port, so a bad --model fails fast and nothing half-starts.
    engine = AsyncLLMEngine.from_config(config)
    app = create_app(engine, api_keys=api_keys, shutdown_engine=True)
    logger.info("serving %r (context %d tokens) on http://%s:%d/v1%s", engine.engine.model_name,
                engine.engine.max_model_len, host, port, " with API keys" if api_keys else "")
    if not api_keys and host not in ("127.0.0.1", "localhost", "::1"):
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
