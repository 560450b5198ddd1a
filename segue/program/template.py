"""Prompt templates of semantic functions: text with `{{input:name}}` and `{{output:name}}` placeholders.

The server keeps the template's structure instead of a rendered string (Parrot §4.1): it knows
where each variable starts, so it can hash prompt prefixes at variable boundaries (§4.2,
PrefixHash) and find calls that share a prefix without comparing tokens. Each segment is
tokenized on its own and the ids are concatenated, as Parrot's Fill does: a static prefix then has
the same token ids in every call, whatever follows it, and the prefix cache can serve it.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable

PLACEHOLDER = re.compile(r"\{\{\s*(input|output)\s*:\s*([A-Za-z_][A-Za-z0-9_]{0,63})\s*\}\}")
# Anything that looks like a placeholder but is not a valid one is a client mistake worth a 400.
_LOOSE = re.compile(r"\{\{[^{}]*\}\}")


class TemplateError(ValueError):
    pass


@dataclass(frozen=True)
class Segment:
    text: str = ""
    # Set for an input placeholder; the segment's text is then the variable's value at render time.
    input_name: str | None = None


@dataclass(frozen=True)
class Template:
    segments: tuple[Segment, ...]
    output_name: str

    @classmethod
    def parse(cls, source: str) -> "Template":
        """Split a template; it needs exactly one output placeholder, at the end (generation
        starts there; text after it would never be seen by the model)."""
        segments: list[Segment] = []
        output: str | None = None
        pos = 0
        for m in PLACEHOLDER.finditer(source):
            literal = source[pos:m.start()]
            _check_literal(literal)
            if output is not None:
                raise TemplateError(f"the template continues after {{{{output:{output}}}}}; the output "
                                    "placeholder must come last (one output per call)")
            if literal:
                segments.append(Segment(literal))
            kind, name = m.group(1), m.group(2)
            if kind == "input":
                segments.append(Segment(input_name=name))
            else:
                output = name
            pos = m.end()
        rest = source[pos:]
        _check_literal(rest)
        if output is None:
            raise TemplateError("the template has no {{output:name}} placeholder")
        if rest.strip():
            raise TemplateError(f"the template continues after {{{{output:{output}}}}}; the output "
                                "placeholder must come last (one output per call)")
        if output in {s.input_name for s in segments}:
            raise TemplateError(f"{output!r} is both an input and the output of this call")
        if not segments:
            raise TemplateError("the template has no text before its output placeholder")
        return cls(tuple(segments), output)

    @property
    def input_names(self) -> list[str]:
        """Each input once, in order of first appearance."""
        return list(dict.fromkeys(s.input_name for s in self.segments if s.input_name is not None))

    def render_text(self, values: dict[str, str]) -> str:
        return "".join(values[s.input_name] if s.input_name is not None else s.text for s in self.segments)

    def render_tokens(self, values: dict[str, str],
                      encode: Callable[[str], list[int]]) -> tuple[list[int], list[int]]:
        """(token ids, token offset where each segment ends)."""
        ids: list[int] = []
        ends: list[int] = []
        for s in self.segments:
            ids += encode(values[s.input_name] if s.input_name is not None else s.text)
            ends.append(len(ids))
        return ids, ends


def prefix_hashes(token_ids: str | list[int], boundaries: list[int], salt: object = None,
                  min_tokens: int = 1) -> list[tuple[int, int]]:
    """(length, hash) of the prompt prefix ending at each variable boundary that holds at least
    `min_tokens` tokens, shortest first. Without a tokenizer the prompt is its text, and lengths
    count characters. Equal hashes mean equal prefixes (up to hash collisions,
    which only cost a wasted wait, never a wrong result: the KV cache checks tokens itself)."""
    out: list[tuple[int, int]] = []
    for end in dict.fromkeys(boundaries):
        if end >= min_tokens:
            out.append((end, hash((salt, tuple(token_ids[:end])))))
    return out


def _check_literal(text: str) -> None:
    bad = _LOOSE.search(text)
    if bad is not None:
        raise TemplateError(f"malformed placeholder {bad.group(0)!r}; use {{{{input:name}}}} or "
                            "{{output:name}} with a name of letters, digits and _")
