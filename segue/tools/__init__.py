"""Segue's tool layer: specs, the operator's registry, tool-call parsing, running and timing.

Pure Python with no torch: the engine imports it to intercept tool calls, run them and resume.
"""
from segue.tools.builtin import BUILTINS, DEFAULT_CORPUS_DIR
from segue.tools.calc import CalculatorError, evaluate
from segue.tools.call_format import HERMES, ToolCallFormat
from segue.tools.parser import ToolCallParser
from segue.tools.registry import RegisteredTool, ToolRegistry, resolve_target
from segue.tools.runner import ToolRunner, truncate
from segue.tools.spec import ToolCall, ToolKind, ToolResult, ToolSpec, ToolSpecError, new_call_id
from segue.tools.stats import DurationStats, DurationSummary

__all__ = [
    "BUILTINS", "DEFAULT_CORPUS_DIR", "HERMES", "CalculatorError", "DurationStats", "DurationSummary",
    "RegisteredTool", "ToolCall", "ToolCallFormat", "ToolCallParser", "ToolKind", "ToolRegistry", "ToolResult",
    "ToolRunner", "ToolSpec", "ToolSpecError", "evaluate", "new_call_id", "resolve_target", "truncate",
]
