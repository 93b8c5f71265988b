"""The calculator tool: a restricted arithmetic parser (Python's `ast`, never `eval`).

Anything but numbers, + - * / // % ** and parentheses is refused with a
message the model can read; sizes are bounded so a tool call cannot hang the
process (e.g. 9**9**9).
"""

from __future__ import annotations

import ast
import operator
from fractions import Fraction

_BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
MAX_EXPRESSION_CHARS = 200
MAX_EXPONENT = 64
MAX_DIGITS = 100


class CalculatorError(ValueError):
    """The expression is not acceptable; the message is shown to the model as the tool's output."""


def _number(value: Fraction) -> Fraction:
    if abs(value.numerator) >= 10**MAX_DIGITS or value.denominator >= 10**MAX_DIGITS:
        raise CalculatorError("result too large")
    return value


def _eval(node: ast.AST) -> Fraction:
    if isinstance(node, ast.Expression):
        return _eval(node.body)
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return Fraction(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_eval(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, (ast.Div, ast.FloorDiv, ast.Mod)) and right == 0:
            raise CalculatorError("division by zero")
        if isinstance(node.op, ast.Pow):
            if right.denominator != 1 or abs(right) > MAX_EXPONENT:
                raise CalculatorError(f"exponents must be integers of at most {MAX_EXPONENT}")
            if left == 0 and right < 0:
                raise CalculatorError("division by zero")
            return _number(left ** int(right))
        return _number(_BINARY[type(node.op)](left, right))
    raise CalculatorError("only numbers, + - * / // % ** and parentheses are allowed")


def calculate(expression: str) -> Fraction:
    expression = expression.strip()
    if not expression:
        raise CalculatorError("empty expression")
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise CalculatorError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression, mode="eval")
    except SyntaxError:
        raise CalculatorError(f"cannot parse {expression!r}") from None
    return _eval(tree)


def format_number(value: Fraction) -> str:
    if value.denominator == 1:
        return str(value.numerator)
    return f"{float(value):.10g}"
