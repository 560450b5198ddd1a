"""`segue serve` keeps idle connections open well past common clients' keep-alive expiry.

An agent's next request comes after its tool ran; if the server closes the idle connection just as
the client reuses it (uvicorn's default 5 s, httpx's default expiry is 5 s too), a client without
retries loses the turn to a connection error. The server must outlast the client's expiry.
"""
from __future__ import annotations

import time

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from segue.cli import build_parser
from segue.server.launch import uvicorn_config
from server_helpers import ServerThread

# Past uvicorn's and httpx's 5 s default, by enough not to race with it.
IDLE_S = 5.5


async def _client_port(request: Request) -> JSONResponse:
    assert request.client is not None
    return JSONResponse({"port": request.client.port})


def test_serve_keeps_idle_connections_longer_than_clients_do() -> None:
    args = build_parser().parse_args(["serve"])
    assert args.timeout_keep_alive >= 75
    assert build_parser().parse_args(["serve", "--timeout-keep-alive", "300"]).timeout_keep_alive == 300
    assert uvicorn_config(Starlette(), args).timeout_keep_alive == args.timeout_keep_alive


@pytest.mark.slow
def test_idle_connection_is_reused_after_the_clients_default_expiry() -> None:
    # The serve path's uvicorn settings (the app is a stub: keep-alive is uvicorn's business).
    app = Starlette(routes=[Route("/port", _client_port)])
    config = uvicorn_config(app, build_parser().parse_args(["--log-level", "WARNING", "serve"]))
    with ServerThread(app, config) as server:
        url = server.url + "/port"
        # A client that keeps idle connections longer than 5 s (as Go's, aiohttp's, OkHttp's do).
        with httpx.Client(limits=httpx.Limits(keepalive_expiry=60), timeout=10) as client:
            first = client.get(url).json()["port"]
            time.sleep(IDLE_S)
            second = client.get(url)
    assert second.status_code == 200
    # The same connection: the server had not closed it (httpx would have opened a new one).
    assert second.json()["port"] == first
