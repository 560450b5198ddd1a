"""Chat messages to prompt text: tools in the prompt, tool calls in the history, and the text that
carries tool results (or a new user turn) into a paused generation.

Two facts shape this module. First, the model's context after a pause is exactly the prompt it was
given plus what it generated, so what we append must be what the chat template would render
after that generated text; we get it by rendering the whole conversation and cutting at the
generated text, rather than by hand-writing any one model family's format. Second, many small
models' templates (SmolLM2's among them) ignore `tools=`; those get the tool list in a system
message, written for the Hermes `<tool_call>` convention that ToolCallParser reads.
"""
from __future__ import annotations

import json
from typing import Any, Callable

import jinja2

from segue.server.errors import APIError
from segue.server.request_bodies import ChatMessage

_PROBE_TOOL = {"type": "function", "function": {"name": "segue_probe_tool", "description": "probe",
                                                 "parameters": {"type": "object", "properties": {}}}}

TOOL_PROMPT = """You can call functions (tools). Their signatures, one JSON object per line:
<tools>
{tools}
</tools>
To call one, write a JSON object with the function's name and an arguments object between \
<tool_call> and </tool_call>, for example:
<tool_call>{{"name": "function_name", "arguments": {{"arg": "value"}}}}</tool_call>
You may make several calls in a row. Each result comes back to you in a message from the tool; \
then continue, calling more functions or answering."""


def tool_call_markup(name: str, arguments: dict[str, Any]) -> str:
    """The Hermes form a model writes a call in (and ToolCallParser reads)."""
    return "<tool_call>" + json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False) + "</tool_call>"


def parse_arguments(text: str) -> dict[str, Any]:
    """OpenAI sends arguments as JSON text; templates want the object. Non-objects stay text."""
    try:
        value = json.loads(text) if text.strip() else {}
    except json.JSONDecodeError:
        return {"_raw": text}
    return value if isinstance(value, dict) else {"_value": value}


class ChatRenderer:
    """Renders chat messages for one model's template (tokenization is the caller's)."""

    def __init__(self, apply_template: Callable[..., str], template_source: str | None) -> None:
        self._apply = apply_template
        # Templates written for tool use render assistant `tool_calls` themselves (Qwen, Hermes);
        # for the rest the calls go into the content as the model would have written them.
        self.native_tool_calls = "tool_calls" in (template_source or "")
        self._renders_tools: bool | None = None
        self._turn_ends: dict[str, bool] = {}

    def _render(self, messages: list[dict[str, Any]], tools: list[dict] | None, add_generation_prompt: bool) -> str:
        try:
            return self._apply(messages, add_generation_prompt=add_generation_prompt, tools=tools)
        except jinja2.TemplateError as e:  # templates raise_exception() on e.g. bad role order
            raise APIError(400, f"the chat template rejected the messages: {e}", param="messages") from e

    def renders_tools(self) -> bool:
        """Whether the template puts `tools=` into the prompt (probed once: a template that ignores
        them renders the same text with and without)."""
        if self._renders_tools is None:
            probe = [{"role": "user", "content": "x"}]
            try:
                self._renders_tools = self._render(probe, [_PROBE_TOOL], True) != self._render(probe, None, True)
            except APIError:
                self._renders_tools = False
        return self._renders_tools

    def render(self, messages: list[dict[str, Any]], tools: list[dict] | None,
               add_generation_prompt: bool = True) -> str:
        if tools and not self.renders_tools():
            return self._render(with_tool_prompt(messages, tools), None, add_generation_prompt)
        return self._render(messages, tools or None, add_generation_prompt)

    def continuation(self, history: list[dict[str, Any]], generated: str, new_messages: list[dict[str, Any]],
                     tools: list[dict] | None) -> str:
        """The text that follows `generated` (the assistant text since the last resume) when
        `new_messages` (tool results, a user turn) join the conversation, ending with the prompt
        for the next assistant turn. `history` is the conversation before `generated`."""
        base = self.render(history, tools)
        full = self.render(history + [{"role": "assistant", "content": generated}] + new_messages, tools)
        if full.startswith(base + generated):
            return full[len(base) + len(generated):]
        # Some templates trim message content; the model still holds the untrimmed text, so cut
        # after the trimmed copy (the whitespace difference is the template's own convention).
        core = generated.strip()
        at = full.find(core, len(base)) if full.startswith(base) and core else -1
        if at < 0:
            raise APIError(500, "the chat template does not render the conversation as a continuation of "
                                "the generated text, so tool results cannot be appended", code="template_error")
        return full[at + len(core):]

    def ends_turn_with(self, text: str) -> bool:
        """Whether the template follows an assistant message's content with `text` (the stop
        token's text) before the next message. Only then can a request paused at that stop token
        continue into the next turn and hold the same context a fresh render would. Probed once
        per text."""
        if text not in self._turn_ends:
            probe = [{"role": "user", "content": "x"}]
            try:
                after = self.continuation(probe, "y", [{"role": "user", "content": "z"}], None)
            except APIError:
                after = ""
            self._turn_ends[text] = bool(text) and after.startswith(text)
        return self._turn_ends[text]

    def template_messages(self, messages: list[ChatMessage]) -> list[dict[str, Any]]:
        """Client messages as chat templates expect them."""
        return [self.template_message(m) for m in messages]

    def template_message(self, m: ChatMessage) -> dict[str, Any]:
        # "developer" is OpenAI's newer name for the system role; templates only know "system".
        msg: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
        if m.name is not None:
            msg["name"] = m.name
        if m.tool_call_id is not None:
            msg["tool_call_id"] = m.tool_call_id
        if m.role == "assistant" and m.tool_calls:
            if self.native_tool_calls:
                msg["tool_calls"] = [{"id": c.id, "type": "function",
                                      "function": {"name": c.function.name,
                                                   "arguments": parse_arguments(c.function.arguments)}}
                                     for c in m.tool_calls]
            else:
                msg["content"] += "".join(tool_call_markup(c.function.name, parse_arguments(c.function.arguments))
                                          for c in m.tool_calls)
        return msg


def with_tool_prompt(messages: list[dict[str, Any]], tools: list[dict]) -> list[dict[str, Any]]:
    """The tool list as (part of) the system message, for templates that ignore `tools=`."""
    lines = "\n".join(json.dumps(t.get("function", t), ensure_ascii=False, sort_keys=True) for t in tools)
    block = TOOL_PROMPT.format(tools=lines)
    if messages and messages[0].get("role") == "system":
        first = dict(messages[0])
        first["content"] = f"{first.get('content') or ''}\n\n{block}".lstrip()
        return [first] + list(messages[1:])
    return [{"role": "system", "content": block}] + list(messages)


def normalize(m: ChatMessage) -> tuple:
    """A comparable form of a client message, to check that a session's history was not edited.
    Whitespace at the ends and the JSON spelling of arguments do not count as edits."""
    calls = tuple((c.id, c.function.name, json.dumps(parse_arguments(c.function.arguments), sort_keys=True))
                  for c in (m.tool_calls or ()))
    role = "system" if m.role == "developer" else m.role
    return role, m.text().strip(), m.name, m.tool_call_id, calls
