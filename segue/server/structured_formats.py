"""Request fields that constrain the output, translated to a StructuredSpec, and what is said
about an answer that breaks its schema.

- `response_format` (OpenAI): {"type": "text"}, {"type": "json_object"}, or
  {"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": ...}}. OpenAI
  defines it for chat only; Segue accepts it on /v1/completions too, as vLLM does.
- vLLM's guided-decoding extras (extra_body), on both endpoints: `guided_json` (a schema, or its
  JSON text), `guided_regex`, `guided_choice` (a list of strings).

The output is constrained whether or not `strict` is set (a non-strict schema is still the best
description of what the client wants). A schema that is not valid JSON Schema is a 400. OpenAI's
contract decides the rest:
- `strict: true` promises an answer that matches the schema, so a keyword the grammar cannot
  enforce (`not`, `if`/`then`, `uniqueItems`, ...; structured/enforceable.py asks llguidance) is a
  400 at request time naming it, before anything is generated.
- Without `strict` (and for `guided_json`) such keywords are left out of the grammar (lenient, as
  OpenAI and vLLM accept them) and the answer is best effort: a finished answer is validated
  against the full schema (`schema_violation`), and one that breaks it is returned as generated,
  its choice marked with a `schema_violation` field saying where and why, and logged. Never a
  5xx: the request was the client's own and nothing failed on the server; a 500 would also make
  the OpenAI SDK send it twice more, and a greedy request would write the same answer each time,
  one bad choice would fail all `n`, and a stream has sent the answer already.
- An answer the client's own `stop` (a string or a token id) or `max_tokens` cut short is not
  checked: its finish reason says why it is unfinished.
"""
from __future__ import annotations

import functools
import json
import logging
from typing import Any

import jsonschema

from segue.server.errors import APIError
from segue.structured import StructuredKind, StructuredSpec
from segue.structured.enforceable import unenforced_keywords

logger = logging.getLogger(__name__)


def _bad(message: str, param: str) -> APIError:
    return APIError(400, message, param=param, code="invalid_response_format")


def _checked_schema(schema: Any, param: str, strict: bool = False) -> StructuredSpec:
    if not isinstance(schema, (dict, bool)):
        raise _bad(f"{param} must be a JSON schema object", param)
    if isinstance(schema, dict):
        cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
        try:
            cls.check_schema(schema)
        except jsonschema.exceptions.SchemaError as e:
            where = "/".join(str(p) for p in e.absolute_path) or "(root)"
            raise _bad(f"{param} is not a valid JSON schema at {where}: {e.message}", param) from None
    if strict:
        unenforced = unenforced_keywords(schema)
        if unenforced:
            names = ", ".join(repr(k) for k in unenforced)
            raise APIError(400, f"{param} uses {names}, which strict structured output cannot enforce: "
                                "remove it, or leave out \"strict\" for a best-effort answer that is "
                                "validated afterwards (marked with schema_violation when it breaks the schema)",
                           param=param, code="unsupported_schema_keyword")
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
        strict = body.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise _bad("response_format.json_schema.strict must be a boolean", "response_format.json_schema.strict")
        return _checked_schema(body.get("schema", {}), "response_format.json_schema.schema", strict is True)
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


def schema_violation(spec: StructuredSpec | None, text: str, finish_reason: str | None,
                     stop_reason: str | int | None) -> str | None:
    """Where and why a finished answer breaks its schema, for the choice's `schema_violation`;
    None when it matches, has no JSON schema, or did not end on its own: cut by max_tokens
    (finish_reason "length") or by the client's own stop string or token (`stop_reason` set)."""
    if finish_reason != "stop" or stop_reason is not None:
        return None
    return answer_problem(spec, text)


def report_violation(problem: str | None, request_id: str, param: str) -> str | None:
    """Log an answer returned despite breaking its schema (the operator's view of how often the
    grammar's leniency shows); returns `problem` for the choice's field."""
    if problem is not None:
        logger.warning("%s: returned an answer that breaks its %s schema %s (marked schema_violation)",
                       request_id, param, problem)
    return problem
