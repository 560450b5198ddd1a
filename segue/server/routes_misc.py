"""/health, /v1/models, /metrics and the session endpoints."""
from __future__ import annotations

from fastapi import APIRouter, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.responses import JSONResponse

from segue.server import responses as r
from segue.server.auth import tenant_of
from segue.server.context import serving

router = APIRouter()


@router.get("/health")
async def health(request: Request) -> Response:
    # Load balancers need a real answer: 503 once the engine loop is gone or shutting down.
    if not serving(request).engine.is_running:
        return JSONResponse({"status": "unavailable"}, status_code=503)
    return JSONResponse({"status": "ok"})


@router.get("/v1/models")
async def list_models(request: Request) -> r.ModelList:
    ctx = serving(request)
    return r.ModelList(data=[r.ModelCard(id=ctx.model_name, created=ctx.created, max_model_len=ctx.max_model_len)])


@router.get("/v1/models/{model_id:path}")
async def get_model(model_id: str, request: Request) -> r.ModelCard:
    ctx = serving(request)
    ctx.check_model(model_id)
    return r.ModelCard(id=ctx.model_name, created=ctx.created, max_model_len=ctx.max_model_len)


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    return Response(await serving(request).metrics.render(), media_type=CONTENT_TYPE_LATEST)


def _close(request: Request, session_id: str) -> Response:
    serving(request).sessions.close(session_id, tenant_of(request))
    return JSONResponse({"id": session_id, "object": "session", "deleted": True})


@router.delete("/v1/sessions/{session_id}")
async def delete_session(session_id: str, request: Request) -> Response:
    """Close a session: its paused request is aborted and its KV freed at once."""
    return _close(request, session_id)


@router.post("/v1/sessions/{session_id}/close")
async def close_session(session_id: str, request: Request) -> Response:
    # For clients that cannot send DELETE (some HTTP tooling and proxies).
    return _close(request, session_id)
