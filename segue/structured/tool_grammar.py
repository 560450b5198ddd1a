"""Grammars for the model's tool-call format, so constrained output is what ToolCallParser parses.

Segue renders tools for the Hermes convention (templating.TOOL_PROMPT) and parses
    <tool_call>{"name": "NAME", "arguments": {...}}</tool_call>
(segue/tools/parser.py). The grammars below emit exactly that: the name is one of the offered
tools and the arguments object is generated under that tool's JSON schema (inlined with %json),
with fixed separators so a small model cannot wander off into unbounded whitespace.

- required / named: the output is one call and nothing else (then only end-of-turn is allowed).
- auto: free text that never contains the start marker, or free text followed by one call. The
  marker is the trigger: once the model writes it, the rest of the call is constrained, so "auto"
  can never produce a malformed call. The engine intercepts right after the end marker, so one call
  per segment is all the grammar needs. "auto" is sticky: every server-side tool round gets it again.
- with an answer format (response_format beside tools, as OpenAI allows): the output is either one
  call or an answer in the format, nothing before either (free text would not be in the format).

Schemas are compiled leniently: keywords llguidance cannot enforce (uniqueItems, not, if/then, ...)
are ignored by the grammar instead of refusing the request, and every call's arguments are then
validated against the full schema with jsonschema (server/chat_tools.py, check_arguments).
"""
from __future__ import annotations

import itertools
import json
from typing import Any

from segue.structured.spec import StructuredSpec

START, END = "<tool_call>", "</tool_call>"
# Compact-but-readable separators, the ones the tool prompt's example uses.
# lenient: ignore the keywords llguidance does not implement (what pydantic emits for a set,
# `not`, ...) rather than fail; an invalid schema (a bad "type") is still an error.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": ", "lenient": True}


def with_json_options(schema: dict[str, Any] | bool) -> dict[str, Any] | bool:
    """The schema as Segue compiles it: llguidance's options attached (x-guidance is its extension
    key) and objects closed (see closed_objects)."""
    if isinstance(schema, bool):
        return schema if not schema else {"x-guidance": JSON_OPTIONS}
    return {**closed_objects(schema), "x-guidance": JSON_OPTIONS}


_SCHEMA_MAPS = ("properties", "$defs", "definitions", "dependentSchemas", "patternProperties")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_VALUES = ("items", "additionalProperties", "not", "contains", "if", "then", "else")


def closed_objects(schema: Any) -> Any:
    """The schema with `additionalProperties: false` on every object schema that lists properties
    and says nothing about others, and sets of a few enum values spelled out (_enum_set). Every
    output is still valid against the original schema (it only narrows what may be generated), and
    a small model then cannot ramble on in invented keys until max_tokens cuts the JSON off.
    xgrammar's default "strict mode" does the same."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {k: closed_objects(v) for k, v in out[key].items()}
    for key in _SCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [closed_objects(v) for v in out[key]]
    for key in _SCHEMA_VALUES:
        if key in out:
            out[key] = closed_objects(out[key])
    if "properties" in out and not any(k in out for k in ("additionalProperties", "patternProperties",
                                                            "unevaluatedProperties")):
        out["additionalProperties"] = False
    items = out.get("items")
    if (out.get("uniqueItems") is True and isinstance(items, dict) and isinstance(items.get("enum"), list)
            and len(items) <= 2 and set(items) <= {"enum", "type"} and len(items["enum"]) <= _MAX_SET_ENUM):
        return _enum_set(out, items["enum"])
    return out


# llguidance cannot enforce uniqueItems (lenient: ignored), and measured, the default model repeats
# a value (["wind", "wind"]) until max_tokens or into a call that fails its schema. A set of a few
# enum values (pydantic's set[Literal[...]]) is spelled out instead: its subsets in enum order.
_MAX_SET_ENUM = 6


def _enum_set(schema: dict[str, Any], values: list[Any]) -> dict[str, Any]:
    lo, hi = schema.get("minItems", 0), min(schema.get("maxItems", len(values)), len(values))
    subsets: list[dict[str, Any]] = [{"maxItems": 0}] if lo == 0 else []
    for n in range(max(lo, 1), hi + 1):
        subsets += [{"prefixItems": [{"const": v} for v in combo], "items": False, "minItems": n}
                    for combo in itertools.combinations(values, n)]
    rest = {k: v for k, v in schema.items() if k not in ("items", "uniqueItems", "minItems", "maxItems")}
    return {**rest, "type": "array", "anyOf": subsets}


def _lit(text: str) -> str:
    # JSON string syntax is valid Lark string-literal syntax for llguidance.
    return json.dumps(text, ensure_ascii=False)


def _json(schema: dict[str, Any] | bool) -> str:
    return "%json " + json.dumps(with_json_options(schema), ensure_ascii=False)


def _call_rules(tools: list[dict[str, Any]]) -> str:
    alts, rules = [], []
    for i, tool in enumerate(tools):
        fn = tool.get("function", tool)
        params = fn.get("parameters") or {"type": "object", "properties": {}}
        head = _lit('{"name": ' + json.dumps(fn["name"], ensure_ascii=False) + ', "arguments": ')
        rules.append(f"call_{i}: {head} {_json(params)} {_lit('}')}")
        alts.append(f"call_{i}")
    return f"call: {_lit(START)} ({' | '.join(alts)}) {_lit(END)}\n" + "\n".join(rules) + "\n"


def _forced_call_rules(tools: list[dict[str, Any]]) -> str:
    # Same as _call_rules without the start marker, which the lazy trigger of "auto" consumes.
    return _call_rules(tools).replace(f"call: {_lit(START)} ", "call_rest: ", 1)


_TEXT = "TEXT: /(.|\\n)*/ & ~/(.|\\n)*" + START + "(.|\\n)*/\n"


def no_call_grammar() -> StructuredSpec:
    """Free text without the start marker: for a conversation about tools in which no call may be
    made (tool_choice "none"). Small models imitate the calls in their history; unconstrained,
    the answer would be call markup returned as text. Sticky, like "auto"."""
    return StructuredSpec.lark("start: TEXT\n" + _TEXT, sticky=True)


def auto_grammar(tools: list[dict[str, Any]], answer: dict[str, Any] | bool | None = None) -> StructuredSpec:
    """Text or one call; with `answer` (a JSON schema: the response_format), an answer in that
    schema or one call. Both hold again after every resume (sticky)."""
    if answer is not None:
        return StructuredSpec.lark(f"start: answer | call\nanswer: {_json(answer)}\n" + _call_rules(tools),
                                   sticky=True)
    lark = (f"start: TEXT | trigger call_rest\n"
            f"{_TEXT}"
            f"trigger[lazy]: /(.|\\n)*/ {_lit(START)}\n" + _forced_call_rules(tools))
    return StructuredSpec.lark(lark, sticky=True)


def forced_grammar(tools: list[dict[str, Any]], all_tools: list[dict[str, Any]] | None = None,
                   answer: dict[str, Any] | bool | None = None) -> StructuredSpec:
    """One call to any of `tools` (a single tool for a named tool_choice). After a resume (the
    call's result joined the context) the model may answer (in text, or in the `answer` schema)
    or make further valid calls to any of `all_tools` (default: `tools`)."""
    if not tools:
        raise ValueError("a forced tool call needs at least one tool")
    return StructuredSpec.lark("start: call\n" + _call_rules(tools),
                               after_resume=auto_grammar(all_tools or tools, answer))
