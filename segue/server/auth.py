"""API keys and tenants.

A tenant is whoever holds one API key. Sessions (and programs) belong to a tenant, and with
`prefix_cache_isolation = "per_key"` each tenant's prompts hash into the prefix cache under its own
salt, so no tenant can learn another's prompts from cache-hit timing. Keys themselves are never
stored past this middleware: routes see a tenant id derived from the key.
"""
from __future__ import annotations

import hashlib
import hmac
import os
import secrets

from starlette.requests import Request
from starlette.types import ASGIApp, Receive, Scope, Send

from segue.server.errors import APIError, error_response

# Paths served without an API key (load balancer probes and scrapers carry no credentials).
OPEN_PATHS = frozenset({"/health", "/metrics"})
_TENANT_KEY = "segue_tenant"
# Per-process secret: salts must not be derivable from a key alone (a tenant knows its own key).
_SALT_SECRET = secrets.token_bytes(32)


def tenant_id(key: bytes) -> str:
    return hashlib.sha256(key).hexdigest()[:32]


def tenant_of(request: Request) -> str | None:
    """The tenant of an authenticated request; None when the server runs without API keys."""
    return request.scope.get("state", {}).get(_TENANT_KEY)


def cache_salt(tenant: str | None) -> str | None:
    if tenant is None:
        return None
    return hmac.new(_SALT_SECRET, tenant.encode(), hashlib.sha256).hexdigest()


def resolve_api_keys(flag_keys: list[str] | None, config_keys: list[str] | None) -> list[str]:
    """--api-key flags and the config file's keys together; SEGUE_API_KEYS (comma separated) when
    neither gives any. Empty: no authentication."""
    keys = list(flag_keys or []) + list(config_keys or [])
    if not keys:
        keys = os.environ.get("SEGUE_API_KEYS", "").split(",")
    return list(dict.fromkeys(k.strip() for k in keys if k and k.strip()))


class APIKeyMiddleware:
    """Bearer-token check in front of everything but OPEN_PATHS. Plain ASGI rather than
    BaseHTTPMiddleware, which would buffer streams and hide client disconnects."""

    def __init__(self, app: ASGIApp, api_keys: list[str]) -> None:
        self.app = app
        self.keys = [k.encode() for k in api_keys]

    def _key(self, scope: Scope) -> bytes | None:
        for name, value in scope.get("headers", []):
            if name == b"authorization":
                scheme, _, token = value.partition(b" ")
                token = token.strip()
                # compare_digest on every key: timing must not reveal which prefix matched.
                hits = [hmac.compare_digest(token, k) for k in self.keys]
                return token if scheme.lower() == b"bearer" and any(hits) else None
        return None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        key = self._key(scope)
        if key is not None:
            scope.setdefault("state", {})[_TENANT_KEY] = tenant_id(key)
        elif scope["path"] not in OPEN_PATHS:
            err = APIError(401, "invalid or missing API key (send Authorization: Bearer <key>)",
                           code="invalid_api_key")
            await error_response(err)(scope, receive, send)
            return
        await self.app(scope, receive, send)
