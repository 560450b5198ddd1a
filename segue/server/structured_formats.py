"""Request fields that constrain the output, translated to a StructuredSpec.

- `response_format` (OpenAI): {"type": "text"}, {"type": "json_object"}, or
  {"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": ...}}. OpenAI
  defines it for chat only; Segue accepts it on /v1/completions too, as vLLM does.
- vLLM's guided-decoding extras (extra_body), on both endpoints: `guided_json` (a schema, or its
  JSON text), `guided_regex`, `guided_choice` (a list of strings).

The output is constrained whether or not `strict` is set (a non-strict schema is still the best
description of what the client wants). A schema that is not valid JSON Schema is a 400; keywords
that are valid but that the grammar library does not enforce (uniqueItems, not, if/then, ...) are
left out of the grammar (segue/structured/tool_grammar.py, lenient), as OpenAI and vLLM accept them
too. So a finished JSON answer is validated against the full schema (check_answer), and one that
breaks it is an error, never a plain success: the client asked for that schema and would otherwise
parse an answer its own validation rejects. An error rather than a hidden resample: a streamed
answer has already been sent, a greedy or seeded request would write the same answer again, and
the client's retry policy (the openai SDK retries a 500) decides whether another try is worth it.
"""
from __future__ import annotations

import functools
import json
from typing import Any

import jsonschema

from segue.server.errors import APIError
from segue.structured import StructuredKind, StructuredSpec


def _bad(message: str, param: str) -> APIError:
    return APIError(400, message, param=param, code="invalid_response_format")


def _checked_schema(schema: Any, param: str) -> StructuredSpec:
    if not isinstance(schema, (dict, bool)):
        raise _bad(f"{param} must be a JSON schema object", param)
    if isinstance(schema, dict):
        cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
        try:
            cls.check_schema(schema)
        except jsonschema.exceptions.SchemaError as e:
            where = "/".join(str(p) for p in e.absolute_path) or "(root)"
            raise _bad(f"{param} is not a valid JSON schema at {where}: {e.message}", param) from None
    return StructuredSpec.json_schema(schema)


def response_format_spec(fmt: dict[str, Any] | None) -> StructuredSpec | None:
    if fmt is None:
        return None
    kind = fmt.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredSpec.json_object()
    if kind == "json_schema":
        body = fmt.get("json_schema")
        if not isinstance(body, dict):
            raise _bad('response_format of type "json_schema" needs a "json_schema" object', "response_format")
        return _checked_schema(body.get("schema", {}), "response_format.json_schema.schema")
    raise _bad(f'response_format.type must be "text", "json_object" or "json_schema", got {kind!r}',
               "response_format.type")


def guided_spec(guided_json: Any, guided_regex: str | None, guided_choice: list[str] | None) -> StructuredSpec | None:
    given = [name for name, v in (("guided_json", guided_json), ("guided_regex", guided_regex),
                                  ("guided_choice", guided_choice)) if v is not None]
    if len(given) > 1:
        raise _bad(f"give at most one of guided_json, guided_regex and guided_choice, got {given}", given[1])
    if guided_json is not None:
        if isinstance(guided_json, str):
            try:
                guided_json = json.loads(guided_json)
            except json.JSONDecodeError as e:
                raise _bad(f"guided_json is not valid JSON: {e}", "guided_json") from None
        return _checked_schema(guided_json, "guided_json")
    if guided_regex is not None:
        return StructuredSpec.regex(guided_regex)
    if guided_choice is not None:
        if not guided_choice or any(not isinstance(c, str) or not c for c in guided_choice):
            raise _bad("guided_choice must be a non-empty list of non-empty strings", "guided_choice")
        return StructuredSpec.choice(guided_choice)
    return None


def output_spec(response_format: dict[str, Any] | None, guided_json: Any, guided_regex: str | None,
                guided_choice: list[str] | None) -> StructuredSpec | None:
    fmt = response_format_spec(response_format)
    guided = guided_spec(guided_json, guided_regex, guided_choice)
    if fmt is not None and guided is not None:
        raise _bad("response_format and guided_* cannot be combined", "response_format")
    return fmt or guided


# The longest part of jsonschema's message (which quotes the offending value) an error repeats.
_MAX_PROBLEM_CHARS = 300


@functools.lru_cache(maxsize=256)
def _validator(schema_text: str) -> Any:
    schema = json.loads(schema_text)
    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    # Formats are checked too (where jsonschema has a checker): the grammar writes some of them
    # looser than their definition (a date's day regardless of its month).
    return cls(schema, format_checker=cls.FORMAT_CHECKER)


def answer_problem(spec: StructuredSpec | None, text: str) -> str | None:
    """Why `text` breaks the JSON schema of `spec`; None when it does not, or when `spec` is not a
    JSON schema (regexes and choices are enforced by the grammar alone)."""
    if spec is None or spec.kind is not StructuredKind.JSON_SCHEMA:
        return None
    try:
        answer = json.loads(text)
    except json.JSONDecodeError as e:
        return f"the answer is not valid JSON ({e})"
    problem = jsonschema.exceptions.best_match(_validator(spec.value).iter_errors(answer))
    if problem is None:
        return None
    where = "/" + "/".join(str(p) for p in problem.absolute_path)
    message = problem.message
    if len(message) > _MAX_PROBLEM_CHARS:
        message = message[:_MAX_PROBLEM_CHARS] + "..."
    return f"at {where}: {message}"


def check_answer(spec: StructuredSpec | None, text: str, finish_reason: str | None, param: str) -> None:
    """Raise when a finished answer breaks its schema (`param`: the request field that gave it). An
    answer cut off by max_tokens is left alone: finish_reason "length" already says it is unfinished."""
    if finish_reason != "stop":
        return
    problem = answer_problem(spec, text)
    if problem is not None:
        raise APIError(500, f"the generated answer does not match the {param} schema {problem}. The grammar "
                            "does not enforce every keyword (not, if/then/else, uniqueItems, ...): they are "
                            "checked after generation", param=param, code="structured_output_invalid")
