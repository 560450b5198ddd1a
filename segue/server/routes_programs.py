"""/v1/programs: Parrot-style programs. Clients submit calls over templates with variable
placeholders and get variables; the calls run server-side as soon as their inputs exist.

Programs, their calls and variables belong to the API key that created them (others get 404).
Clients send templates, values and declarative transforms only: no client code runs here.
"""
from __future__ import annotations

import contextlib
from typing import AsyncIterator, TypeVar

from fastapi import APIRouter, FastAPI, Query, Request
from pydantic import BaseModel
from starlette.responses import JSONResponse

from segue.engine.engine_request import RequestHints
from segue.program.executor import ProgramExecutor
from segue.program.state import ProgramError
from segue.program.variables import Criteria
from segue.program.wire import (
    CallCreate,
    ProgramCreate,
    VariableCreate,
    VariableSet,
    call_json,
    program_json,
    variable_json,
)
from segue.server.auth import cache_salt, tenant_of
from segue.server.context import serving
from segue.server.errors import APIError
from segue.server.openapi import json_body

M = TypeVar("M", bound=BaseModel)
# The longest a single GET waits for a variable; clients poll again for longer waits.
MAX_GET_WAIT_S = 600.0


@contextlib.asynccontextmanager
async def _lifespan(app: FastAPI) -> AsyncIterator[None]:
    yield
    executor = getattr(app.state, "programs", None)
    if executor is not None:
        # Before the engine stops: running calls are cancelled and their requests aborted.
        await executor.aclose()


router = APIRouter(lifespan=_lifespan)


def programs(request: Request) -> ProgramExecutor:
    state = request.app.state
    executor = getattr(state, "programs", None)
    if executor is None:
        ctx = serving(request)
        executor = ProgramExecutor(ctx.engine, encode=ctx.engine.encode, max_model_len=ctx.max_model_len,
                                   call_timeout_s=ctx.config.request_timeout_s)
        state.programs = executor
    return executor


async def _body(request: Request, model: type[M]) -> M:
    raw = await request.body()
    return model.model_validate_json(raw or b"{}")


def _api_error(e: ProgramError) -> APIError:
    return APIError(e.status, str(e), code=e.code)


@router.post("/v1/programs", openapi_extra=json_body(ProgramCreate))
async def create_program(request: Request) -> JSONResponse:
    """A program is the session its calls and variables live in; deleting it cancels them all."""
    await _body(request, ProgramCreate)
    ctx, tenant = serving(request), tenant_of(request)
    try:
        hints = RequestHints(cache_salt=ctx.prefix_cache_salt(cache_salt(tenant)))
        program = programs(request).create_program(tenant, hints)
    except ProgramError as e:
        raise _api_error(e) from None
    return JSONResponse(program_json(program))


@router.get("/v1/programs/{program_id}")
async def get_program(program_id: str, request: Request) -> JSONResponse:
    try:
        program = programs(request).registry.program(tenant_of(request), program_id)
    except ProgramError as e:
        raise _api_error(e) from None
    return JSONResponse(program_json(program, detail=True))


@router.delete("/v1/programs/{program_id}")
async def delete_program(program_id: str, request: Request) -> JSONResponse:
    try:
        programs(request).delete_program(tenant_of(request), program_id)
    except ProgramError as e:
        raise _api_error(e) from None
    return JSONResponse({"id": program_id, "object": "program", "deleted": True})


@router.post("/v1/programs/variables", openapi_extra=json_body(VariableCreate))
async def create_variable(request: Request) -> JSONResponse:
    body = await _body(request, VariableCreate)
    try:
        var = programs(request).create_variable(tenant_of(request), body.program_id, body.name, body.value)
    except ProgramError as e:
        raise _api_error(e) from None
    return JSONResponse(variable_json(var))


@router.post("/v1/programs/variables/{var_id}", openapi_extra=json_body(VariableSet))
async def set_variable(var_id: str, request: Request) -> JSONResponse:
    body = await _body(request, VariableSet)
    try:
        var = programs(request).set_variable(tenant_of(request), var_id, body.value)
    except ProgramError as e:
        raise _api_error(e) from None
    return JSONResponse(variable_json(var))


@router.get("/v1/programs/variables/{var_id}")
async def get_variable(var_id: str, request: Request, criteria: Criteria | None = None,
                       timeout: float = Query(default=60.0, ge=0.0, le=MAX_GET_WAIT_S)) -> JSONResponse:
    """Wait up to `timeout` seconds for the value. `criteria` tells the scheduler what the client
    optimizes (Parrot's get(perf=...)); calls that have not reached the engine yet follow it.
    Answers 200 with status "ready" (and the value) or "pending" (timeout passed: ask again), or
    424 with the first failed step's error."""
    executor, tenant = programs(request), tenant_of(request)
    try:
        var = executor.mark(tenant, var_id, criteria) if criteria is not None \
            else executor.registry.variable(tenant, var_id)[1]
    except ProgramError as e:
        raise _api_error(e) from None
    await var.wait(timeout)
    if var.error is not None:
        raise APIError(424, f"variable {var.name!r} ({var.id}) could not be produced: {var.error}",
                       code="variable_failed", param=var.error.step)
    return JSONResponse(variable_json(var))


@router.post("/v1/programs/calls", openapi_extra=json_body(CallCreate))
async def submit_call(request: Request) -> JSONResponse:
    """Submit one call of a semantic function; it returns at once with its output variable."""
    body = await _body(request, CallCreate)
    try:
        call = programs(request).submit(tenant_of(request), body.program_id, body.to_spec(), body.criteria)
    except ProgramError as e:
        raise _api_error(e) from None
    return JSONResponse(call_json(call))
