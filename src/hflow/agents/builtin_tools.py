"""The built-in tools: ``calculator`` (arithmetic read from the syntax tree, never eval'd) and
``python`` (a program run in hflow's code sandbox, hflow.sandbox)."""
from __future__ import annotations

import ast
import math
import operator
import textwrap

from hflow.agents.tools import ToolInputError, tool

MAX_EXPRESSION_CHARS = 300
MAX_INT_BITS = 4096   # ~1230 digits: any honest arithmetic fits; 9**9**9 does not get computed

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}


@tool(tag="calc", inline=True)   # bounded by construction: no timeout or worker needed
def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression: numbers, + - * / // % ** and parentheses.

    Args:
        expression: The expression, for example "27*82" or "(3 + 4.5) / 2".
    """
    expression = expression.strip()
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ToolInputError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression, mode="eval")
    except (SyntaxError, ValueError, MemoryError, RecursionError) as e:
        raise ToolInputError(f"not an arithmetic expression ({type(e).__name__})") from None
    return _format(_evaluate(tree.body))


def _evaluate(node: ast.AST):
    if isinstance(node, ast.Constant):
        if isinstance(node.value, bool) or not isinstance(node.value, (int, float)):
            raise ToolInputError(f"only numbers, not {node.value!r}")
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_evaluate(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        _refuse_huge(node.op, left, right)
        try:
            value = _BINARY[type(node.op)](left, right)
        except ZeroDivisionError:
            raise ToolInputError("division by zero") from None
        except OverflowError:
            raise ToolInputError("result too large") from None
        if isinstance(value, complex):
            raise ToolInputError("the result is not a real number")
        if isinstance(value, float) and not math.isfinite(value):
            raise ToolInputError("result too large")
        return value
    if isinstance(node, ast.Name):
        raise ToolInputError(f"names are not allowed ({node.id}); write the numbers")
    raise ToolInputError(f"not arithmetic: {type(node).__name__} (only numbers, + - * / // % ** and parentheses)")


def _bits(x: int) -> int:
    return abs(x).bit_length()


def _refuse_huge(op: ast.operator, left, right) -> None:
    """Refuse an int result past MAX_INT_BITS before computing it (floats overflow on their own)."""
    if not (isinstance(left, int) and isinstance(right, int)):
        return
    if isinstance(op, ast.Mult) and _bits(left) + _bits(right) > MAX_INT_BITS:
        raise ToolInputError("result too large")
    if isinstance(op, ast.Pow) and right > 0 and abs(left) > 1 and right * math.log2(abs(left)) > MAX_INT_BITS:
        raise ToolInputError("result too large")


def _format(value) -> str:
    if isinstance(value, int):
        return str(value)
    # 12 significant digits: 0.1 + 0.2 reads 0.3, and 27 / 3 reads 9
    return f"{value:.12g}"


# ---------------------------------------------------------------- python

_PYTHON_LIMITS = None   # the sandbox's limits, made on first use: importing the sandbox costs ~100 ms
_OUTPUT_EXCEPTION = "_HflowToolOutput"
# The sandbox's public entry point reports back tests' verdicts and the program's exception, the
# latter cut to 400 characters: the program's output travels as that exception's message.
_OUTPUT_CHARS = 380
# The program runs as a sandbox uid that may be unable to read the standard library (an
# interpreter under /root): it imports nothing beyond built-in modules (_ast is one).
_RUNNER = '''\
import _ast, sys
class {exception}(BaseException):
    pass
class _Buffer:
    def __init__(self):
        self.parts = []
    def write(self, text):
        self.parts.append(str(text))
        return len(text)
    def flush(self):
        pass
_buffer = _Buffer()
sys.stdout = sys.stderr = _buffer
try:
    _tree = compile({code!r}, "<python>", "exec", _ast.PyCF_ONLY_AST)
    _last = _tree.body.pop() if _tree.body and isinstance(_tree.body[-1], _ast.Expr) else None
    _namespace = {{"__name__": "__main__"}}
    exec(compile(_tree, "<python>", "exec"), _namespace)
    if _last is not None:   # like a notebook cell: the last expression's value is shown
        _value = eval(compile(_ast.Expression(_last.value), "<python>", "eval"), _namespace)
        if _value is not None:
            print(repr(_value))
except BaseException as _e:
    _frames, _tb = [], _e.__traceback__
    while _tb is not None:
        if _tb.tb_frame.f_code.co_filename == "<python>":
            _frames.append(f'  File "<python>", line {{_tb.tb_lineno}}, in {{_tb.tb_frame.f_code.co_name}}')
        _tb = _tb.tb_next
    if _frames:
        print("Traceback (most recent call last):")
        print("\\n".join(_frames))
    if isinstance(_e, SyntaxError):
        print(f"SyntaxError: {{_e.msg}} (line {{_e.lineno}})")
    else:
        print(f"{{type(_e).__name__}}: {{_e}}" if str(_e) else type(_e).__name__)
_text, _cut = "".join(_buffer.parts), "0"
while len(repr(_text)) > {limit}:
    _text, _cut = _text[:len(_text) - max(1, (len(repr(_text)) - {limit}) // 2)], "1"
raise {exception}(_cut + repr(_text))
'''


@tool()
def python(code: str) -> str:
    """Run a Python program and return what it prints, and the value of its last line if that is an expression.

    Args:
        code: The program. Only the standard library is available; no network, no files outside its own folder, a few seconds of time.
    """
    from hflow.sandbox import SandboxLimits, run_tests

    global _PYTHON_LIMITS
    if _PYTHON_LIMITS is None:
        _PYTHON_LIMITS = SandboxLimits(wall_seconds=5.0, cpu_seconds=3.0, memory_bytes=512 << 20)
    source = _RUNNER.format(exception=_OUTPUT_EXCEPTION, code=textwrap.dedent(code), limit=_OUTPUT_CHARS)
    result = run_tests(source, [], _PYTHON_LIMITS)
    prefix = f"{_OUTPUT_EXCEPTION}: "
    if result.error and result.error.startswith(prefix):
        payload = result.error[len(prefix):]
        try:
            text = ast.literal_eval(payload[1:])
        except (ValueError, SyntaxError):
            raise RuntimeError(f"python tool: unreadable output report {payload[:60]!r}") from None
        return text + (" [output truncated]" if payload[0] == "1" else "")
    # the program never reached its end: a limit stopped it (or it ended its own process)
    return f"error: the program was stopped: {result.error or 'no report'}"
