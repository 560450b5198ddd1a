"""A safe arithmetic evaluator for the calculator tool.

The expression comes from model output, i.e. from whoever wrote the prompt, so it is parsed with
`ast` and only a whitelist of node types is interpreted; nothing is ever handed to eval/exec. Integer
arithmetic in Python is unbounded, so result sizes are bounded explicitly to keep one call from
eating the CPU or memory the serving engine needs.
"""
from __future__ import annotations

import ast
import math
import operator
from typing import Callable

Number = int | float

MAX_EXPRESSION_CHARS = 1000
MAX_DEPTH = 64
# ~3000 decimal digits: ample for arithmetic questions, and below Python's int->str digit limit.
MAX_INT_BITS = 10_000
MAX_EXPONENT = 10_000


class CalculatorError(ValueError):
    """The expression is not allowed or cannot be evaluated; the message is meant for the model."""


def _pow(a: Number, b: Number) -> Number:
    if abs(b) > MAX_EXPONENT:
        raise CalculatorError(f"exponent {b} is too large (limit {MAX_EXPONENT})")
    if isinstance(a, int) and isinstance(b, int) and b > 0 and abs(a) > 1:
        # Bound the result's size before computing it: (10**1000)**1000 would take minutes.
        if (abs(a).bit_length() - 1) * b > MAX_INT_BITS:
            raise CalculatorError(f"the power's result would be too large (limit {MAX_INT_BITS} bits)")
    try:
        return a ** b
    except OverflowError:
        raise CalculatorError("result is too large") from None


_BINARY: dict[type[ast.operator], Callable[[Number, Number], Number]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: _pow,
}
_UNARY: dict[type[ast.unaryop], Callable[[Number], Number]] = {ast.USub: operator.neg, ast.UAdd: operator.pos}
_CONSTANTS: dict[str, float] = {"pi": math.pi, "e": math.e}


def _round(x: Number, ndigits: int | None = None) -> Number:
    if ndigits is not None and (not isinstance(ndigits, int) or abs(ndigits) > 100):
        raise CalculatorError("round() digits must be an integer between -100 and 100")
    return round(x, ndigits) if ndigits is not None else round(x)


# name -> (function, min args, max args)
_FUNCTIONS: dict[str, tuple[Callable[..., Number], int, int]] = {
    "sqrt": (math.sqrt, 1, 1), "sin": (math.sin, 1, 1), "cos": (math.cos, 1, 1), "tan": (math.tan, 1, 1),
    "log": (math.log, 1, 2), "exp": (math.exp, 1, 1), "abs": (abs, 1, 1), "round": (_round, 1, 2),
    "min": (min, 1, 100), "max": (max, 1, 100),
}


def evaluate(expression: str) -> Number:
    """Evaluate an arithmetic expression; raises CalculatorError with a model-readable reason."""
    if not isinstance(expression, str):
        raise CalculatorError("expression must be a string")
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise CalculatorError(f"expression is too long ({len(expression)} characters, "
                              f"limit {MAX_EXPRESSION_CHARS})")
    if not expression.strip():
        raise CalculatorError("expression is empty")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as exc:
        raise CalculatorError(f"invalid syntax: {exc.msg}") from None
    except (RecursionError, MemoryError):  # the parser's own stack on pathological nesting
        raise CalculatorError("expression is nested too deeply") from None
    return _Evaluator().visit(tree.body, 0)


def format_number(x: Number) -> str:
    if isinstance(x, float):
        if not math.isfinite(x):
            raise CalculatorError("result is not a finite number")
        # Integral floats read better without the ".0" when they are exactly representable.
        if x.is_integer() and abs(x) < 2 ** 53:
            return str(int(x))
        return repr(x)
    return str(x)


class _Evaluator:
    def visit(self, node: ast.AST, depth: int) -> Number:
        if depth > MAX_DEPTH:
            raise CalculatorError("expression is nested too deeply")
        depth += 1
        if isinstance(node, ast.Constant):
            # bool is an int subclass and complex is a number; neither belongs in arithmetic answers.
            if isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
                return node.value
            raise CalculatorError(f"only numbers are allowed, got {node.value!r}")
        if isinstance(node, ast.BinOp):
            if isinstance(node.op, ast.BitXor):
                raise CalculatorError("'^' is not supported; use ** for powers")
            op = _BINARY.get(type(node.op))
            if op is None:
                raise CalculatorError(f"operator {type(node.op).__name__} is not allowed")
            left, right = self.visit(node.left, depth), self.visit(node.right, depth)
            try:
                return self._bounded(op(left, right))
            except ZeroDivisionError:
                raise CalculatorError("division by zero") from None
            except OverflowError:
                raise CalculatorError("result is too large") from None
        if isinstance(node, ast.UnaryOp):
            unary = _UNARY.get(type(node.op))
            if unary is None:
                raise CalculatorError(f"operator {type(node.op).__name__} is not allowed")
            return unary(self.visit(node.operand, depth))
        if isinstance(node, ast.Name):
            if node.id in _CONSTANTS:
                return _CONSTANTS[node.id]
            raise CalculatorError(f"unknown name {node.id!r} (constants: {', '.join(_CONSTANTS)})")
        if isinstance(node, ast.Call):
            return self._call(node, depth)
        if isinstance(node, ast.Attribute):
            raise CalculatorError("attribute access is not allowed")
        raise CalculatorError(f"{type(node).__name__} expressions are not allowed")

    def _call(self, node: ast.Call, depth: int) -> Number:
        if not isinstance(node.func, ast.Name):
            raise CalculatorError("only calls to named math functions are allowed")
        entry = _FUNCTIONS.get(node.func.id)
        if entry is None:
            raise CalculatorError(f"unknown function {node.func.id!r} (allowed: {', '.join(_FUNCTIONS)})")
        fn, lo, hi = entry
        if node.keywords or any(isinstance(a, ast.Starred) for a in node.args):
            raise CalculatorError(f"{node.func.id}() takes plain positional arguments only")
        if not lo <= len(node.args) <= hi:
            raise CalculatorError(f"{node.func.id}() takes {lo if lo == hi else f'{lo} to {hi}'} "
                                  f"argument(s), got {len(node.args)}")
        args = [self.visit(a, depth) for a in node.args]
        try:
            return self._bounded(fn(*args))
        except CalculatorError:
            raise
        except (ValueError, OverflowError, ZeroDivisionError) as exc:
            raise CalculatorError(f"{node.func.id}(): {exc}") from None

    @staticmethod
    def _bounded(x: Number) -> Number:
        # A negative base to a fractional power gives a complex number in Python; not an answer here.
        if isinstance(x, complex):
            raise CalculatorError("result is not a real number")
        # Catches growth that bypasses _pow, e.g. products of many large powers.
        if isinstance(x, int) and x.bit_length() > MAX_INT_BITS:
            raise CalculatorError("result is too large")
        # Float arithmetic overflows to inf silently (1e308 * 10); say so instead of answering "inf".
        if isinstance(x, float) and not math.isfinite(x):
            raise CalculatorError("result is not a finite number")
        return x
