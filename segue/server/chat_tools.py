"""Which tools a chat request offers the model, and how tool_choice steers it.

Tools are the client's (`tools`, run by the client) plus the operator's (the server config, run here).
They are validated as the OpenAI API defines them, with real JSON-schema checks, because a schema
error found only when the model calls the tool would surface as a confusing tool failure.

tool_choice is enforced by constrained decoding (segue/structured/tool_grammar.py): "required" and
a named function constrain the output to one call in the format ToolCallParser reads, with a name
among the tools (the named one) and arguments generated under that tool's JSON schema; "auto"
allows free text or such a call, so it never yields a malformed one. "none" hides every tool and
never intercepts. A response_format beside tools (OpenAI allows it; the Agents SDK sends both for
an agent with tools and an output type) makes the answer either a call or text in that format.
Calls are checked against their schema once more when parsed (check_arguments): what reaches a
client or a server-side tool is valid, or the call carries an error.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

import jsonschema

from segue.sampling_params import InvalidRequestError
from segue.server.errors import APIError
from segue.structured import StructuredKind, StructuredSpec
from segue.structured.tool_grammar import auto_grammar, forced_grammar
from segue.tools.registry import ToolRegistry
from segue.tools.spec import ToolCall, ToolSpecError, check_parameters_schema

_NAME_RE = re.compile(r"[a-zA-Z0-9_-]{1,64}")
MAX_TOOLS = 128


def _bad(message: str, param: str) -> APIError:
    return APIError(400, message, param=param, code="invalid_tool_schema")


@dataclass
class ToolSetup:
    # OpenAI `tools` entries rendered into the prompt (client's first, then the operator's).
    tools: list[dict[str, Any]] = field(default_factory=list)
    client_names: frozenset[str] = frozenset()
    server_names: frozenset[str] = frozenset()
    # The grammar the output follows (tool_choice auto / required / named); None: unconstrained.
    constraint: StructuredSpec | None = None
    # What a text answer must match (response_format, guided_*), checked once it is finished
    # (structured_formats.schema_violation), and the request field it came from.
    answer: StructuredSpec | None = None
    answer_param: str = "response_format"

    @property
    def enabled(self) -> bool:
        return bool(self.tools)

    def check_arguments(self, call: ToolCall) -> ToolCall:
        """The call, with `error` set when its arguments do not validate against its tool's schema
        (constrained decoding makes that rare: a call cut off, a schema keyword the grammar library
        cannot enforce)."""
        if call.error is not None:
            return call
        tool = next((t["function"] for t in self.tools if t["function"]["name"] == call.name), None)
        if tool is None:
            return call
        schema = tool.get("parameters") or {"type": "object"}
        cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
        problem = jsonschema.exceptions.best_match(cls(schema).iter_errors(call.arguments))
        if problem is not None:
            call.error = f"arguments do not match the schema of {call.name!r}: {problem.message}"
        return call

    def is_client_call(self, call: ToolCall) -> bool:
        # Calls to unknown names (or unparsable ones) stay on the server: the runner answers them
        # with an error the model can read, instead of handing the client a function it never defined.
        # A client call whose arguments fail their schema stays here too: the runner answers it
        # with the error, so no client ever receives arguments its schema rejects.
        return call.name in self.client_names and call.error is None


def validate_client_tools(tools: list[Any] | None) -> list[dict[str, Any]]:
    if not tools:
        return []
    if len(tools) > MAX_TOOLS:
        raise _bad(f"at most {MAX_TOOLS} tools are allowed, got {len(tools)}", "tools")
    out, seen = [], set()
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
            raise _bad(f'{where} must be {{"type": "function", "function": {{...}}}}', where)
        fn = tool["function"]
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME_RE.fullmatch(name):
            raise _bad(f"{where}.function.name must be 1-64 characters of a-z, A-Z, 0-9, _ or -, got {name!r}",
                       f"{where}.function.name")
        if name in seen:
            raise _bad(f"{where}: the tool name {name!r} is used twice", f"{where}.function.name")
        seen.add(name)
        description = fn.get("description", "")
        if not isinstance(description, str):
            raise _bad(f"{where}.function.description must be a string", f"{where}.function.description")
        parameters = fn.get("parameters", {"type": "object", "properties": {}})
        try:
            check_parameters_schema(parameters, f"{where}.function.parameters")
        except ToolSpecError as e:
            raise _bad(str(e), f"{where}.function.parameters") from None
        entry = {"name": name, "description": description, "parameters": parameters}
        out.append({"type": "function", "function": entry})
    return out


def _answer_schema(answer: StructuredSpec | None) -> dict[str, Any] | bool | None:
    """The JSON schema an answer beside tools must follow (response_format, guided_json)."""
    if answer is None:
        return None
    if answer.kind is not StructuredKind.JSON_SCHEMA:
        raise APIError(400, "guided_regex and guided_choice cannot be combined with tools (response_format "
                            "and guided_json can)", param="tools")
    return json.loads(answer.value)


def resolve_tools(tools: list[Any] | None, tool_choice: str | dict[str, Any] | None,
                  registry: ToolRegistry, answer: StructuredSpec | None = None) -> ToolSetup:
    """The tools and the grammar of a chat request; `answer`: the constraint of a text answer
    (response_format), which the grammar then offers beside the calls."""
    client = validate_client_tools(tools)
    server = registry.openai_tools()
    client_names = frozenset(t["function"]["name"] for t in client)
    server_names = frozenset(registry.names())
    clash = client_names & server_names
    if clash:
        raise _bad(f"tool name(s) {sorted(clash)} are already server-side tools of this deployment; "
                   "rename yours", "tools")
    choice = "auto" if tool_choice is None else tool_choice
    if choice == "none":
        return ToolSetup()
    setup = ToolSetup(client + server, client_names, server_names)
    schema = _answer_schema(answer) if setup.enabled else None
    if isinstance(choice, dict):
        fn = choice.get("function")
        name = fn.get("name") if choice.get("type") == "function" and isinstance(fn, dict) else None
        if not isinstance(name, str):
            raise InvalidRequestError('tool_choice must be "none", "auto", "required" or '
                                      '{"type": "function", "function": {"name": ...}}', param="tool_choice",
                                      code="invalid_value")
        if name not in client_names | server_names:
            raise APIError(400, f"tool_choice names {name!r}, which is not among the tools", param="tool_choice")
        named = [t for t in setup.tools if t["function"]["name"] == name]
        setup.constraint = forced_grammar(named, setup.tools, schema)
    elif choice == "required":
        if not setup.enabled:
            raise APIError(400, 'tool_choice "required" needs at least one tool', param="tool_choice")
        setup.constraint = forced_grammar(setup.tools, answer=schema)
    elif choice != "auto":
        raise InvalidRequestError(f'tool_choice must be "none", "auto", "required" or a function, got {choice!r}',
                                  param="tool_choice", code="invalid_value")
    elif setup.enabled:
        setup.constraint = auto_grammar(setup.tools, schema)
    return setup

