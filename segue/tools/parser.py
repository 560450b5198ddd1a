"""Finding tool calls in generated text.

Default format is the Hermes one used by Qwen, SmolLM2 and others (call_format.HERMES):
    <tool_call>{"name": "calculator", "arguments": {"expression": "2+2"}}</tool_call>

A call ends at the first end marker after its start marker that is not inside a JSON string of
its payload: an argument may contain "</tool_call>" as text. The engine intercepts by the same
rule (has_complete_call, token by token), so parsing never disagrees with where generation was
paused. A payload that is not JSON (it does not start with { or [) ends at the first end marker.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from segue.tools.call_format import HERMES, ToolCallFormat
from segue.tools.spec import ToolCall


@dataclass(frozen=True)
class _Span:
    start: int  # index of the start marker
    end: int  # index just past the end marker, or len(text) when unterminated
    payload: str
    terminated: bool


class ToolCallParser:
    """Stateless: one format's markers and the rules above."""

    def __init__(self, start: str = HERMES.start, end: str = HERMES.end) -> None:
        if not start or not end:
            raise ValueError("tool call start and end markers must be non-empty")
        self.start = start
        self.end = end

    @classmethod
    def for_format(cls, fmt: ToolCallFormat) -> "ToolCallParser":
        return cls(fmt.start, fmt.end)

    @property
    def stop_strings(self) -> list[str]:
        """Strings that, once generated, mean a call is complete and generation should pause."""
        return [self.end]

    def _end_of(self, text: str, body: int) -> int:
        """Index of the end marker that closes the call whose payload starts at `body`; -1 if none
        has been written yet."""
        first = text.find(self.end, body)
        payload = text[body:].lstrip()
        if first < 0 or not payload or payload[0] not in "{[" or '"' not in text[body:first]:
            return first
        in_string = escaped = False
        for i in range(body, len(text)):
            c = text[i]
            if in_string:
                if escaped:
                    escaped = False
                elif c == "\\":
                    escaped = True
                elif c == '"':
                    in_string = False
            elif c == '"':
                in_string = True
            elif text.startswith(self.end, i):
                return i
        return -1

    def _spans(self, text: str) -> list[_Span]:
        spans: list[_Span] = []
        pos = 0
        while (s := text.find(self.start, pos)) >= 0:
            body = s + len(self.start)
            e = self._end_of(text, body)
            if e < 0:
                spans.append(_Span(s, len(text), text[body:], False))
                break
            spans.append(_Span(s, e + len(self.end), text[body:e], True))
            pos = e + len(self.end)
        return spans

    def find_calls(self, text: str, *, strip: bool = True) -> tuple[str, list[ToolCall]]:
        """Split text into content (everything outside calls) and the calls, in order.

        A call that cannot be parsed becomes a ToolCall with `error` set (name "" when even the name
        is unknown), so the caller can report it to the model. An unterminated call at the end of
        the text (generation stopped inside it) is such an error call too. With strip=False the
        content is returned verbatim, which is what streaming (see safe_prefix_len) needs.
        """
        pieces: list[str] = []
        calls: list[ToolCall] = []
        pos = 0
        for span in self._spans(text):
            pieces.append(text[pos:span.start])
            raw = text[span.start:span.end]
            if span.terminated:
                calls.extend(parse_payload(span.payload, raw))
            else:
                calls.append(ToolCall(name="", raw=raw, error=f"unterminated tool call: no {self.end} "
                                                              f"after {self.start}"))
            pos = span.end
        pieces.append(text[pos:])
        content = "".join(pieces)
        return (content.strip() if strip else content), calls

    def content(self, text: str) -> str:
        """The text outside calls, verbatim: find_calls(text, strip=False)'s content, without
        parsing the calls (for a caller that gets them parsed elsewhere, from the engine)."""
        pieces: list[str] = []
        pos = 0
        for span in self._spans(text):
            pieces.append(text[pos:span.start])
            pos = span.end
        pieces.append(text[pos:])
        return "".join(pieces)

    def has_complete_call(self, text: str, pos: int = 0) -> bool:
        """True once an end marker follows a start marker: the moment to intercept.

        `pos` skips text already handled (say, calls before the last resume), so the check after
        each token need not rescan, and answer again for, old calls.
        """
        s = text.find(self.start, pos)
        return s >= 0 and self._end_of(text, s + len(self.start)) >= 0

    def safe_prefix_len(self, text: str) -> int:
        """Length of the prefix that can be streamed to the client as it is.

        The prefix stops before an unfinished call, and before a tail that might be the beginning
        of a start marker ("<tool" may still become "<tool_call>"). Complete calls may lie inside
        it: boundaries never fall inside a call, so find_calls(text[a:b], strip=False) over
        consecutive boundaries a, b yields the content deltas and the calls, in order.
        """
        pos = 0
        for span in self._spans(text):
            if not span.terminated:
                return span.start
            pos = span.end
        return len(text) - _partial_marker_suffix(text, self.start, pos)


def _partial_marker_suffix(text: str, marker: str, lo: int) -> int:
    """Length of the longest suffix of text[lo:] that is a proper prefix of marker."""
    longest = min(len(marker) - 1, len(text) - lo)
    for n in range(longest, 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


def parse_payload(payload: str, raw: str = "") -> list[ToolCall]:
    """The calls in one marker-delimited JSON payload: an object, or a list of objects."""
    raw = raw or payload
    try:
        data = json.loads(payload)
    except json.JSONDecodeError as exc:
        return [ToolCall(name="", raw=raw, error=f"tool call is not valid JSON: {exc}")]
    if isinstance(data, list) and data:
        # Some models batch parallel calls in one block; each gets its own id and result.
        return [_to_call(item, raw) for item in data]
    return [_to_call(data, raw)]


def _to_call(data: Any, raw: str) -> ToolCall:
    if not isinstance(data, dict):
        return ToolCall(name="", raw=raw, error='tool call must be a JSON object with "name" and "arguments"')
    name = data.get("name")
    if not isinstance(name, str) or not name:
        return ToolCall(name="", raw=raw, error='tool call has no "name" string')
    # "parameters" is what Llama-3-style templates ask for; accept it so those models work too.
    args: Any = data.get("arguments", data.get("parameters", {}))
    if isinstance(args, str):
        # OpenAI-style: arguments serialized as a JSON string. An empty string means no arguments.
        if not args.strip():
            args = {}
        else:
            try:
                args = json.loads(args)
            except json.JSONDecodeError as exc:
                return ToolCall(name=name, raw=raw, error=f"arguments string is not valid JSON: {exc}")
    if args is None:
        args = {}
    if not isinstance(args, dict):
        return ToolCall(name=name, raw=raw, error=f"arguments must be a JSON object, got {type(args).__name__}")
    return ToolCall(name=name, arguments=args, raw=raw)
