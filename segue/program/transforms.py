"""Output transforms: declarative specs applied to a call's generated text before it becomes a
variable's value (Parrot §5.1's string transformation on value exchange).

A transform is data, never code: the client names one of a few kinds and its parameters, and the
server applies them. Regular expressions come from clients, so their length and the text they
run on are capped; Python's `re` has no timeout, and a short pattern on bounded text keeps the
worst case small.
"""
from __future__ import annotations

import enum
import json
import re
from dataclasses import dataclass
from typing import Any

MAX_PATTERN_CHARS = 256
MAX_PATH_PARTS = 16


class TransformError(ValueError):
    """A transform could not be applied to an output (no match, not JSON, missing field)."""


class TransformKind(str, enum.Enum):
    STRIP = "strip"
    JSON_FIELD = "json_field"
    REGEX = "regex"


@dataclass(frozen=True)
class Transform:
    kind: TransformKind
    # json_field: a dotted path ("answer.items.0"); integer parts index lists.
    path: str | None = None
    # regex: searched (not matched) in the text; `group` picks the capture group (0: the whole match).
    pattern: str | None = None
    group: int = 0

    def __post_init__(self) -> None:
        """Reject malformed specs at submit time, so a bad transform is a 400 and not a failed call."""
        if self.kind is TransformKind.JSON_FIELD:
            if not self.path or len(self.path.split(".")) > MAX_PATH_PARTS:
                raise ValueError(f"json_field needs a dotted `path` of at most {MAX_PATH_PARTS} parts")
        elif self.kind is TransformKind.REGEX:
            if not self.pattern or len(self.pattern) > MAX_PATTERN_CHARS:
                raise ValueError(f"regex needs a `pattern` of 1 to {MAX_PATTERN_CHARS} characters")
            try:
                compiled = re.compile(self.pattern)
            except re.error as e:
                raise ValueError(f"invalid regex pattern {self.pattern!r}: {e}") from None
            if not 0 <= self.group <= compiled.groups:
                raise ValueError(f"regex group {self.group} does not exist (the pattern has {compiled.groups})")

    def apply(self, text: str) -> str:
        if self.kind is TransformKind.STRIP:
            return text.strip()
        if self.kind is TransformKind.REGEX:
            assert self.pattern is not None
            match = re.search(self.pattern, text)
            if match is None:
                raise TransformError(f"regex {self.pattern!r} found no match in the output {_excerpt(text)}")
            return match.group(self.group) or ""
        return _json_field(text, self.path or "")


def apply_all(transforms: list[Transform], text: str) -> str:
    for t in transforms:
        text = t.apply(text)
    return text


def _json_field(text: str, path: str) -> str:
    try:
        value: Any = json.loads(_json_span(text))
    except ValueError:
        raise TransformError(f"the output is not JSON: {_excerpt(text)}") from None
    for part in path.split("."):
        if isinstance(value, dict) and part in value:
            value = value[part]
        elif isinstance(value, list) and part.lstrip("-").isdigit() and -len(value) <= int(part) < len(value):
            value = value[int(part)]
        else:
            raise TransformError(f"JSON field {path!r} is missing (at {part!r}) in the output {_excerpt(text)}")
    return value if isinstance(value, str) else json.dumps(value)


def _json_span(text: str) -> str:
    """The JSON value in a model's output, which often wraps it in prose or a ``` fence."""
    starts = [i for i in (text.find("{"), text.find("[")) if i >= 0]
    if not starts:
        return text
    start = min(starts)
    end = max(text.rfind("}"), text.rfind("]"))
    return text[start:end + 1] if end > start else text


def _excerpt(text: str, limit: int = 120) -> str:
    return repr(text if len(text) <= limit else text[:limit] + "...")
