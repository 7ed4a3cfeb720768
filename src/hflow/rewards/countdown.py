"""Countdown (as in TinyZero): reach the target with the given numbers, each used exactly once.

The response ends its reasoning with ``<answer> (25 - 5) * 4 </answer>``; the last such tag
counts. Scores: 1 for a right equation, ``format_score`` (0.1) for a tagged equation that is
wrong (numbers reused or missing, not evaluable, wrong value), 0 without an answer tag.

The equation is evaluated by walking its syntax tree with exact fractions, allowing only
integers, + - * / and parentheses: nothing is ``eval``-ed and no power can blow up.
"""
import ast
import operator
import re
from fractions import Fraction
from typing import Optional

from hflow.rewards import inline_safe

_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_MAX_EQUATION_CHARS = 200  # a countdown equation over a few numbers is short
_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
           ast.Div: operator.truediv}


def extract_equation(response: str) -> Optional[str]:
    matches = _ANSWER.findall(response)
    return matches[-1].strip() if matches else None


def evaluate_equation(equation: str) -> Fraction:
    """The exact value of an arithmetic expression; ValueError / ZeroDivisionError otherwise."""
    if len(equation) > _MAX_EQUATION_CHARS:
        raise ValueError("equation too long")
    try:
        tree = ast.parse(equation, mode="eval")
    except SyntaxError as e:
        raise ValueError(f"not an expression: {equation!r}") from e

    def walk(node) -> Fraction:
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return Fraction(node.value)
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            return _BINARY[type(node.op)](walk(node.left), walk(node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            value = walk(node.operand)
            return -value if isinstance(node.op, ast.USub) else value
        raise ValueError(f"not allowed in an equation: {ast.dump(node)[:40]}")

    return walk(tree.body)


def _numbers_and_target(ground_truth, extra) -> tuple[list[int], int]:
    if isinstance(ground_truth, dict):
        numbers = ground_truth.get("numbers", ground_truth.get("nums"))
        target = ground_truth["target"]
    else:
        numbers, target = extra.get("numbers", extra.get("nums")), ground_truth
    if numbers is None:
        raise ValueError("countdown needs the numbers: a ground truth {'target': .., 'numbers': ..}"
                         " or a 'numbers' column")
    return [int(n) for n in numbers], int(target)


@inline_safe
def countdown_score(response: str, ground_truth, format_score: float = 0.1, score: float = 1.0,
                    **extra) -> dict:
    """``ground_truth`` is ``{"target": 24, "numbers": [3, 5, 2, 7]}`` (or the target, with a
    ``numbers``/``nums`` column in ``extra``). Metrics: ``answer_found``, ``numbers_ok``."""
    numbers, target = _numbers_and_target(ground_truth, extra)
    equation = extract_equation(response)
    if equation is None:
        return {"score": 0.0, "answer_found": 0.0, "numbers_ok": 0.0}
    used = sorted(int(n) for n in re.findall(r"\d+", equation))
    if used != sorted(numbers):
        return {"score": format_score, "answer_found": 1.0, "numbers_ok": 0.0}
    try:
        value = evaluate_equation(equation)
    except (ValueError, ZeroDivisionError):
        return {"score": format_score, "answer_found": 1.0, "numbers_ok": 1.0}
    return {"score": score if value == target else format_score, "answer_found": 1.0,
            "numbers_ok": 1.0}
