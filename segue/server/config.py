"""Server-side settings (limits, sessions, keys, tools), read from the `segue serve --config` file.

The file is JSON or TOML with the ServerConfig fields at the top level plus the operator's `tools`
list in ToolRegistry.from_config's format, so one file describes a whole deployment:

    {"api_keys": ["sk-..."], "max_concurrent_requests": 128, "session_ttl_s": 300,
     "tools": [{"builtin": "calculator"}, {"builtin": "search", "corpus_dir": "docs"}]}

Unknown keys are an error: a misspelt limit silently left at its default is worse than a refusal.
"""
from __future__ import annotations

import dataclasses
import json
import pathlib
import tomllib
from dataclasses import dataclass, field
from typing import Any, Mapping

from segue.tools.registry import ToolRegistry
from segue.tools.spec import ToolSpecError


class ServerConfigError(ValueError):
    pass


@dataclass
class ServerConfig:
    api_keys: list[str] = field(default_factory=list)
    # Generation requests running or queued in the engine at once; more get 429 at the door
    # instead of queueing without bound (paused session requests do not count).
    max_concurrent_requests: int = 256
    # Whole-request wall time, tool rounds included; past it the request is aborted (504).
    request_timeout_s: float = 600.0
    max_body_bytes: int = 8 * 1024 * 1024
    # Sessions idle this long are closed and their paused request (and KV) freed.
    session_ttl_s: float = 600.0
    max_sessions: int = 1024
    # Server-side tool rounds inside one response before it is cut off with finish_reason "length".
    max_tool_rounds: int = 8
    # "per_key": tenants (API keys) never share prefix-cache blocks, so one cannot time another's
    # prompts; "shared": everyone shares (better hit rate, fine for a single tenant).
    prefix_cache_isolation: str = "per_key"
    # Plain clients (no session fields) get their held turn continued when their next request
    # extends it (auto_continue.py). A held turn nobody continued is released to the prefix cache
    # (still continuable, minus what gets evicted) after auto_continue_release_s idle, and
    # dropped after auto_continue_ttl_s.
    auto_continue: bool = False
    auto_continue_release_s: float = 10.0
    auto_continue_ttl_s: float = 60.0

    def validate(self) -> "ServerConfig":
        def positive(name: str) -> None:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise ServerConfigError(f"{name} must be a positive number, got {value!r}")

        for name in ("max_concurrent_requests", "request_timeout_s", "max_body_bytes", "session_ttl_s",
                     "max_sessions", "max_tool_rounds", "auto_continue_release_s", "auto_continue_ttl_s"):
            positive(name)
        if not isinstance(self.auto_continue, bool):
            raise ServerConfigError(f"auto_continue must be true or false, got {self.auto_continue!r}")
        if self.prefix_cache_isolation not in ("per_key", "shared"):
            raise ServerConfigError(f"prefix_cache_isolation must be 'per_key' or 'shared', "
                                    f"got {self.prefix_cache_isolation!r}")
        if not isinstance(self.api_keys, list) or not all(isinstance(k, str) and k for k in self.api_keys):
            raise ServerConfigError("api_keys must be a list of non-empty strings")
        return self


_FIELDS = {f.name for f in dataclasses.fields(ServerConfig)}


def parse_server_config(data: Mapping[str, Any]) -> ServerConfig:
    unknown = set(data) - _FIELDS - {"tools"}
    if unknown:
        raise ServerConfigError(f"unknown server config key(s) {sorted(unknown)}; "
                                f"allowed: {sorted(_FIELDS | {'tools'})}")
    try:
        return ServerConfig(**{k: v for k, v in data.items() if k in _FIELDS}).validate()
    except TypeError as exc:
        raise ServerConfigError(str(exc)) from None


def load_server_config(path: str | pathlib.Path | None) -> tuple[ServerConfig, ToolRegistry]:
    """The settings and the operator's tools from a config file; defaults and no tools for None."""
    if path is None:
        return ServerConfig(), ToolRegistry()
    path = pathlib.Path(path)
    try:
        raw = path.read_bytes()
        data = tomllib.loads(raw.decode("utf-8")) if path.suffix.lower() == ".toml" else json.loads(raw)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, tomllib.TOMLDecodeError) as exc:
        raise ServerConfigError(f"cannot read server config {str(path)!r}: {exc}") from None
    if not isinstance(data, dict):
        raise ServerConfigError(f"server config {str(path)!r} must hold an object")
    config = parse_server_config(data)
    try:
        # From the path, not the dict: builtin options like corpus_dir resolve against its folder.
        registry = ToolRegistry.from_config(path) if "tools" in data else ToolRegistry()
    except ToolSpecError as exc:
        raise ServerConfigError(f"server config {str(path)!r}: {exc}") from None
    return config, registry
