"""How a model writes a tool call: the markers around its JSON payload, as plain data.

A ToolCallFormat is what crosses process and thread boundaries (the server names the format a
request's calls use, a Ray replica receives it pickled); each side builds its own stateless
ToolCallParser from it (ToolCallParser.for_format), so no parser object is shared.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ToolCallFormat:
    """The markers around one call's payload; the payload is a JSON object (or a list of them)."""
    start: str = "<tool_call>"
    end: str = "</tool_call>"

    def __post_init__(self) -> None:
        if not self.start or not self.end:
            raise ValueError("tool call start and end markers must be non-empty")


# The Hermes format used by Qwen, SmolLM2 and others:
#     <tool_call>{"name": "calculator", "arguments": {"expression": "2+2"}}</tool_call>
HERMES = ToolCallFormat()
