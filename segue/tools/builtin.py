"""Built-in tools for demos and tests: calculator, wait and search.

Each builtin is a factory taking its config options (the config entry minus the keys the registry
handles itself) and returning the spec and the function, so one builtin can be registered twice with
different options (say, two `search` tools over two corpora under different names).
"""
from __future__ import annotations

import asyncio
import pathlib
from typing import Any, Callable, Mapping

from segue.tools.bm25 import BM25Index, load_passages
from segue.tools.calc import evaluate, format_number
from segue.tools.spec import ToolKind, ToolSpec, ToolSpecError

ToolFunction = Callable[..., Any]
BuiltinFactory = Callable[[Mapping[str, Any]], tuple[ToolSpec, ToolFunction]]

DEFAULT_CORPUS_DIR = pathlib.Path(__file__).resolve().parent / "corpus"
MAX_WAIT_SECONDS = 600.0


def _check_options(builtin: str, options: Mapping[str, Any], allowed: set[str]) -> None:
    unknown = set(options) - allowed
    if unknown:
        raise ToolSpecError(f"builtin {builtin!r}: unknown option(s) {sorted(unknown)}; "
                            f"allowed: {sorted(allowed) or 'none'}")


def make_calculator(options: Mapping[str, Any]) -> tuple[ToolSpec, ToolFunction]:
    _check_options("calculator", options, set())

    def calculator(expression: str) -> str:
        return format_number(evaluate(expression))

    spec = ToolSpec(
        name="calculator",
        description=("Evaluate an arithmetic expression and return the number. Supports + - * / // % **, "
                     "parentheses, sqrt, sin, cos, tan, log, exp, abs, round, min, max and the constants "
                     "pi and e."),
        parameters={"type": "object",
                    "properties": {"expression": {"type": "string",
                                                  "description": "for example: (3 + 4) * sqrt(2)"}},
                    "required": ["expression"], "additionalProperties": False},
        kind=ToolKind.PYTHON, timeout_s=5.0, expected_seconds=0.001,
    )
    return spec, calculator


def make_wait(options: Mapping[str, Any]) -> tuple[ToolSpec, ToolFunction]:
    _check_options("wait", options, {"max_seconds"})
    cap = float(options.get("max_seconds", MAX_WAIT_SECONDS))
    if not 0 < cap <= MAX_WAIT_SECONDS:
        raise ToolSpecError(f"builtin 'wait': max_seconds must be in (0, {MAX_WAIT_SECONDS:g}], got {cap!r}")

    async def wait(seconds: float) -> str:
        # Clamp rather than refuse: the tool exists to simulate slow calls, and a clear message
        # about the clamped value is more useful to the model than an error.
        waited = min(max(float(seconds), 0.0), cap)
        await asyncio.sleep(waited)
        return f"waited {waited:g} s"

    spec = ToolSpec(
        name="wait",
        description=f"Wait for the given number of seconds (at most {cap:g}), then return.",
        parameters={"type": "object",
                    "properties": {"seconds": {"type": "number", "minimum": 0}},
                    "required": ["seconds"], "additionalProperties": False},
        kind=ToolKind.PYTHON,
        # The timeout must not cut the longest allowed wait short.
        timeout_s=cap + 5.0,
    )
    return spec, wait


def make_search(options: Mapping[str, Any]) -> tuple[ToolSpec, ToolFunction]:
    _check_options("search", options, {"corpus_dir", "max_k"})
    corpus_dir = pathlib.Path(options.get("corpus_dir") or DEFAULT_CORPUS_DIR)
    max_k = int(options.get("max_k", 10))
    try:
        passages = load_passages(corpus_dir)
    except (FileNotFoundError, OSError) as exc:
        raise ToolSpecError(f"builtin 'search': {exc}") from None
    if not passages:
        raise ToolSpecError(f"builtin 'search': no .txt or .md passages under {str(corpus_dir)!r}")
    # Built once at registration: searches then cost a scan of term counts, no file I/O.
    index = BM25Index(passages)

    def search(query: str, k: int = 3) -> str:
        hits = index.search(query, max(1, min(int(k), max_k)))
        if not hits:
            return f"no passages match {query!r}"
        return "\n\n".join(f"[{i}] {h.passage.source}: {h.passage.text}" for i, h in enumerate(hits, 1))

    spec = ToolSpec(
        name="search",
        description="Search a local collection of reference passages and return the best matches "
                    "with their file names.",
        parameters={"type": "object",
                    "properties": {"query": {"type": "string", "minLength": 1},
                                   "k": {"type": "integer", "minimum": 1, "maximum": max_k, "default": 3}},
                    "required": ["query"], "additionalProperties": False},
        kind=ToolKind.PYTHON, timeout_s=10.0, expected_seconds=0.01,
    )
    return spec, search


BUILTINS: dict[str, BuiltinFactory] = {
    "calculator": make_calculator,
    "wait": make_wait,
    "search": make_search,
}
