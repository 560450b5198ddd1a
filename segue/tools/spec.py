"""What a tool is (ToolSpec), what the model asked for (ToolCall) and what came back (ToolResult).

Pure data plus validation: nothing here imports or runs a tool, so specs can be built from untrusted
config and checked before anything is resolved.
"""
from __future__ import annotations

import enum
import json
import math
import re
import secrets
from dataclasses import dataclass, field
from typing import Any

import jsonschema
import jsonschema.exceptions
import jsonschema.validators

# OpenAI's limit on function names; chat templates and clients assume it too.
_NAME_RE = re.compile(r"[a-zA-Z0-9_-]{1,64}")
# "pkg.mod:attr" or "pkg.mod:Class.attr"; the colon keeps the import path unambiguous.
_PYTHON_TARGET_RE = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_][\w.]*")


class ToolSpecError(ValueError):
    """A tool definition (or config entry) that cannot be used."""


class ToolKind(str, enum.Enum):
    PYTHON = "python"
    HTTP = "http"


def new_call_id() -> str:
    # 24 hex digits: unique enough within a conversation, short enough to cost few prompt tokens.
    return "call_" + secrets.token_hex(12)


@dataclass(frozen=True)
class ToolSpec:
    """An operator-registered tool. `parameters` is the JSON schema of the arguments object."""

    name: str
    description: str
    parameters: dict[str, Any]
    kind: ToolKind = ToolKind.PYTHON
    # "pkg.mod:func" for PYTHON (may be "" when the registry is handed the callable), a URL for HTTP.
    target: str = ""
    timeout_s: float = 30.0
    # Operator's hint for the scheduler until real durations have been observed.
    expected_seconds: float | None = None
    max_concurrency: int = 8
    max_result_chars: int = 16384

    def __post_init__(self) -> None:
        # A frozen dataclass still accepts plain strings for the enum; normalize so comparisons hold.
        if not isinstance(self.kind, ToolKind):
            try:
                object.__setattr__(self, "kind", ToolKind(self.kind))
            except ValueError:
                raise ToolSpecError(f"tool {self.name!r}: kind must be one of "
                                    f"{[k.value for k in ToolKind]}, got {self.kind!r}") from None
        self.validate()

    def validate(self) -> None:
        if not isinstance(self.name, str) or not _NAME_RE.fullmatch(self.name):
            raise ToolSpecError(f"tool name {self.name!r} must be 1-64 characters of a-z, A-Z, 0-9, _ or -")
        where = f"tool {self.name!r}"
        if not isinstance(self.description, str):
            raise ToolSpecError(f"{where}: description must be a string")
        check_parameters_schema(self.parameters, where)
        if self.kind is ToolKind.PYTHON:
            if self.target and not _PYTHON_TARGET_RE.fullmatch(self.target):
                raise ToolSpecError(f"{where}: python target {self.target!r} must look like 'pkg.module:function'")
        elif not re.match(r"https?://[^/\s]+", self.target or ""):
            raise ToolSpecError(f"{where}: HTTP target must be an http:// or https:// URL, got {self.target!r}")
        if not _positive_finite(self.timeout_s):
            raise ToolSpecError(f"{where}: timeout_s must be a positive number, got {self.timeout_s!r}")
        if self.expected_seconds is not None and not (
                _positive_finite(self.expected_seconds) or _is_zero(self.expected_seconds)):
            raise ToolSpecError(f"{where}: expected_seconds must be a non-negative number, "
                                f"got {self.expected_seconds!r}")
        for attr in ("max_concurrency", "max_result_chars"):
            value = getattr(self, attr)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ToolSpecError(f"{where}: {attr} must be a positive integer, got {value!r}")

    def to_openai(self) -> dict[str, Any]:
        """The OpenAI `tools` entry; also what HF chat templates expect in `tools=`."""
        return {"type": "function",
                "function": {"name": self.name, "description": self.description, "parameters": self.parameters}}


def _positive_finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0


def _is_zero(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x == 0


def check_parameters_schema(schema: Any, where: str = "tool") -> None:
    """Raise ToolSpecError unless `schema` is a valid JSON Schema describing an object."""
    if not isinstance(schema, dict):
        raise ToolSpecError(f"{where}: parameters must be a JSON schema object, got {type(schema).__name__}")
    # Honour an explicit "$schema" draft; default to the latest draft jsonschema knows.
    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    try:
        cls.check_schema(schema)
    except jsonschema.exceptions.SchemaError as exc:
        path = "/".join(str(p) for p in exc.absolute_path) or "(root)"
        raise ToolSpecError(f"{where}: parameters is not a valid JSON schema at {path}: {exc.message}") from None
    if schema.get("type") != "object":
        raise ToolSpecError(f"{where}: parameters must have \"type\": \"object\" "
                            f"(tool arguments are a JSON object), got {schema.get('type')!r}")


@dataclass
class ToolCall:
    """One call parsed from generated text. `error` is set when the call could not be parsed, so the
    caller can tell the model what went wrong instead of failing the request."""

    name: str
    arguments: dict[str, Any] = field(default_factory=dict)
    raw: str = ""
    id: str = field(default_factory=new_call_id)
    error: str | None = None

    def to_openai(self) -> dict[str, Any]:
        """The OpenAI `tool_calls` entry (arguments travel as a JSON string there)."""
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": json.dumps(self.arguments, ensure_ascii=False)}}


@dataclass
class ToolResult:
    call_id: str
    name: str
    content: str
    is_error: bool = False
    duration_s: float = 0.0
    truncated: bool = False

    def to_message(self) -> dict[str, Any]:
        """The chat message that carries this result back to the model (role "tool")."""
        return {"role": "tool", "tool_call_id": self.call_id, "name": self.name, "content": self.content}
