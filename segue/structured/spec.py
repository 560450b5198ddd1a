"""What a request's output must match: a plain, hashable description (no grammar library here).

The spec is the cache key of compiled grammars. JSON schemas keep their key order (it is the order
the properties are generated in, as in OpenAI's structured outputs), so only schemas written the
same way share a compiled grammar.
"""
from __future__ import annotations

import enum
import json
from dataclasses import dataclass
from typing import Any


class StructuredKind(enum.Enum):
    JSON_SCHEMA = "json_schema"
    # A Lark grammar in llguidance's dialect (may inline JSON schemas with %json).
    LARK = "lark"
    REGEX = "regex"


@dataclass(frozen=True)
class StructuredSpec:
    kind: StructuredKind
    value: str
    # The constraint of what the request generates after a resume (a tool result joined its
    # context): a forced tool call is followed by free text or further valid calls, not by another
    # forced call, which would loop. None: unconstrained after a resume (unless sticky).
    after_resume: StructuredSpec | None = None
    # The same constraint again after every resume: "auto" tool calling (and "none") hold in every
    # server-side tool round, not only the first. A flag rather than after_resume=self, which a
    # frozen, hashable spec cannot refer to.
    sticky: bool = False

    @property
    def next_after_resume(self) -> StructuredSpec | None:
        """What constrains the output generated after a resume (see after_resume, sticky)."""
        return self if self.sticky else self.after_resume

    @classmethod
    def json_schema(cls, schema: dict[str, Any] | bool) -> StructuredSpec:
        return cls(StructuredKind.JSON_SCHEMA, json.dumps(schema, ensure_ascii=False))

    @classmethod
    def json_object(cls) -> StructuredSpec:
        return cls.json_schema({"type": "object"})

    @classmethod
    def lark(cls, grammar: str, after_resume: StructuredSpec | None = None, sticky: bool = False) -> StructuredSpec:
        return cls(StructuredKind.LARK, grammar, after_resume, sticky)

    @classmethod
    def regex(cls, pattern: str) -> StructuredSpec:
        return cls(StructuredKind.REGEX, pattern)

    @classmethod
    def choice(cls, options: list[str]) -> StructuredSpec:
        body = " | ".join(json.dumps(o, ensure_ascii=False) for o in options)
        return cls.lark(f"start: {body}\n")
