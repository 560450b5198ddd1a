"""Which tools a chat request offers the model, and how tool_choice steers it.

Tools are the client's (`tools`, run by the client) plus the operator's (the server config, run here).
They are validated as the OpenAI API defines them, with real JSON-schema checks, because a schema
error found only when the model calls the tool would surface as a confusing tool failure.

tool_choice cannot be enforced by constrained decoding (the engine has none), so "required" and a
named function are steered by prefilling the assistant turn with the start of a call; the model
then only has to complete it. "none" hides every tool and never intercepts.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from segue.sampling_params import InvalidRequestError
from segue.server.errors import APIError
from segue.tools.parser import ToolCallParser
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
    # Text the assistant turn starts with to steer tool_choice ("" for auto / none).
    forced_prefix: str = ""

    @property
    def enabled(self) -> bool:
        return bool(self.tools)

    def is_client_call(self, call: ToolCall) -> bool:
        # Calls to unknown names (or unparsable ones) stay on the server: the runner answers them
        # with an error the model can read, instead of handing the client a function it never defined.
        return call.name in self.client_names


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


def resolve_tools(tools: list[Any] | None, tool_choice: str | dict[str, Any] | None,
                  registry: ToolRegistry) -> ToolSetup:
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
    if isinstance(choice, dict):
        fn = choice.get("function")
        name = fn.get("name") if choice.get("type") == "function" and isinstance(fn, dict) else None
        if not isinstance(name, str):
            raise InvalidRequestError('tool_choice must be "none", "auto", "required" or '
                                      '{"type": "function", "function": {"name": ...}}', param="tool_choice",
                                      code="invalid_value")
        if name not in client_names | server_names:
            raise APIError(400, f"tool_choice names {name!r}, which is not among the tools", param="tool_choice")
        setup.forced_prefix = '<tool_call>{"name": ' + json.dumps(name) + ', "arguments": '
    elif choice == "required":
        if not setup.enabled:
            raise APIError(400, 'tool_choice "required" needs at least one tool', param="tool_choice")
        setup.forced_prefix = "<tool_call>"
    elif choice != "auto":
        raise InvalidRequestError(f'tool_choice must be "none", "auto", "required" or a function, got {choice!r}',
                                  param="tool_choice", code="invalid_value")
    return setup


class SteeredParser(ToolCallParser):
    """ToolCallParser that sees the prefilled start of a call as if the model had written it.

    The engine feeds the parser the text generated since the last resume, which lacks the prefill.
    The prefix applies to the first segment only: a call completes it, and the parser disarms when
    the engine asks for the calls (once, at the interception). `arm()` sets a new prefix for a
    session's next turn. Both run on the engine thread or before the turn's resume is queued.
    """

    def __init__(self, prefix: str = "") -> None:
        super().__init__()
        self.prefix = prefix

    def arm(self, prefix: str) -> None:
        self.prefix = prefix

    def has_complete_call(self, text: str, pos: int = 0) -> bool:
        return super().has_complete_call(self.prefix + text, pos)

    def find_calls(self, text: str, *, strip: bool = True) -> tuple[str, list[ToolCall]]:
        prefix, self.prefix = self.prefix, ""
        return super().find_calls(prefix + text, strip=strip)

    def plain(self) -> ToolCallParser:
        """A parser without the prefill logic, for splitting text on the server side."""
        return ToolCallParser(self.start, self.end)
