"""OpenAI-style error responses: {"error": {"message", "type", "param", "code"}}.

Every failure leaves the server in this shape, because OpenAI clients parse it to build their
exception (BadRequestError, NotFoundError, ...) and show `message` to the user. Unexpected
exceptions become a generic 500: the traceback goes to the log, never to the client.
"""
from __future__ import annotations

import json
import logging
import re
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from segue.engine.protocol import EngineDeadError
from segue.sampling_params import InvalidRequestError

logger = logging.getLogger(__name__)

# Union branch labels that pydantic puts in error locations ("prompt.list[int].0").
_UNION_TAGS = {"str", "int", "float", "bool", "none"}
_GENERIC_TAG = re.compile(r"^\w+\[.*\]$")


class APIError(Exception):
    """An error with an HTTP status, raised anywhere in a route and rendered by the handler."""

    def __init__(self, status_code: int, message: str, type: str | None = None,
                 param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.type = type or default_error_type(status_code)
        self.param = param
        self.code = code
        # e.g. Retry-After on a 429, which clients use to pace their retries.
        self.headers = headers


def default_error_type(status_code: int) -> str:
    # OpenAI reports client errors as invalid_request_error (401 included) and 5xx as server_error.
    return "server_error" if status_code >= 500 else "invalid_request_error"


def error_payload(message: str, type: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def error_json(err: APIError) -> str:
    """The error as a JSON string, also used for errors sent inside an SSE stream."""
    return json.dumps(error_payload(err.message, err.type, err.param, err.code))


def error_response(err: APIError) -> JSONResponse:
    return JSONResponse(error_payload(err.message, err.type, err.param, err.code), status_code=err.status_code,
                        headers=err.headers)


def to_api_error(exc: BaseException) -> APIError:
    """Map any exception to the error the client should see."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, InvalidRequestError):
        return APIError(400, str(exc), param=exc.param, code=exc.code)
    if isinstance(exc, (RequestValidationError, ValidationError)):
        return _validation_error(exc.errors())
    if isinstance(exc, EngineDeadError):
        return APIError(503, "the engine is not running", code="engine_unavailable")
    logger.error("unexpected error while serving a request", exc_info=exc)
    return APIError(500, "internal server error", code="internal_error")


def _validation_error(errors: Any) -> APIError:
    errors = list(errors)
    if any(e.get("type") == "json_invalid" for e in errors):
        detail = next(e for e in errors if e.get("type") == "json_invalid").get("ctx", {}).get("error", "")
        return APIError(400, f"the request body is not valid JSON{': ' + detail if detail else ''}",
                        code="invalid_json")
    parts, first_param = [], None
    for e in errors[:5]:
        # FastAPI prefixes body locations with "body"; clients know fields by their own name.
        loc = [str(x) for x in e.get("loc", ()) if x != "body"]
        # A union (e.g. prompt: str | list[str] | list[int]) adds its branch names to loc.
        loc = [x for x in loc if x not in _UNION_TAGS and not _GENERIC_TAG.match(x)]
        param = ".".join(loc) or None
        first_param = first_param or param
        parts.append(f"{param or 'body'}: {e.get('msg', 'invalid value')}")
    return APIError(400, "invalid request: " + "; ".join(parts), param=first_param, code="invalid_value")


def install_error_handlers(app: FastAPI) -> None:
    async def handle(_: Request, exc: Exception) -> JSONResponse:
        return error_response(to_api_error(exc))

    async def handle_http(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, StarletteHTTPException)
        # Unknown routes (404), wrong methods (405) and the like, in OpenAI's shape too.
        return error_response(APIError(exc.status_code, str(exc.detail)))

    for exc_type in (APIError, InvalidRequestError, RequestValidationError, ValidationError,
                     EngineDeadError, Exception):
        app.add_exception_handler(exc_type, handle)
    app.add_exception_handler(StarletteHTTPException, handle_http)
