"""MATH-style answers: the last ``\\boxed{}``, normalised, then compared as strings and with sympy.

Normalisation (after Hendrycks et al.'s MATH grader) removes what does not change the value:
spaces and LaTeX spacing, ``\\left``/``\\right``, ``\\dfrac``/``\\tfrac`` (-> ``\\frac``), dollar
and percent signs, degrees, trailing units (``\\text{ cm}``, "12 apples"), thousands separators,
``x = `` prefixes; ``\\frac12`` and ``1/2`` become ``\\frac{1}{2}``.

When the strings still differ, both are translated to sympy (our own small LaTeX reader: fractions,
roots, powers, products, pi, infinity, a few functions, one-letter variables) and compared: numbers
to a relative 1e-9 (so ``0.5 == \\frac{1}{2}`` and ``\\frac{\\sqrt{2}}{2} == \\frac{1}{\\sqrt{2}}``),
expressions with variables by ``simplify(a - b) == 0``. Comma-separated answers (tuples, lists)
are compared element by element. Anything the reader does not know stays a string comparison.

sympy can be slow on adversarial input, so this scorer is not ``inline_safe``: batches run in the
worker pool, under its timeout.
"""
import cmath
import re
from typing import Optional

_BOX_COMMANDS = ("\\boxed", "\\fbox")


def last_boxed(text: str) -> Optional[str]:
    """The content of the last ``\\boxed{...}`` (nested braces matched) or ``\\boxed 5``."""
    start, command = max((text.rfind(c), c) for c in _BOX_COMMANDS)
    if start < 0:
        return None
    rest = text[start + len(command):]
    if rest.startswith(" "):  # "\boxed 5$" form
        return rest.strip().split("$")[0].strip() or None
    if not rest.startswith("{"):
        return None
    depth = 0
    for i, ch in enumerate(rest):
        depth += (ch == "{") - (ch == "}")
        if depth == 0:
            return rest[1:i]
    return None  # unbalanced: the response was cut off inside the box


# ---------------------------------------------------------------- normalisation

_TEXT_COMMAND = r"\\(?:text|textbf|textrm|mbox|mathrm)"
_TRAILING_UNIT = re.compile(r"^(.+?)\s*" + _TEXT_COMMAND + r"\{[^{}]*\}$")
_WORD_UNIT = re.compile(r"^(-?[\d.,]+)\s+[a-zA-Z][a-zA-Z .]*$")
_THOUSANDS = re.compile(r"^-?\d{1,3}(?:,\d{3})+(?:\.\d+)?$")


def _fix_fracs(s: str) -> str:
    """``\\frac12`` -> ``\\frac{1}{2}``, ``\\frac1{72}`` -> ``\\frac{1}{72}``."""
    parts = s.split("\\frac")
    out = parts[0]
    for part in parts[1:]:
        out += "\\frac"
        if part.startswith("{") or len(part) < 2:
            out += part
        elif part[1] == "{":
            out += "{" + part[0] + "}" + part[1:]
        else:
            out += "{" + part[0] + "}{" + part[1] + "}" + part[2:]
    return out


def normalize_answer(answer: str) -> str:
    s = str(answer).strip().replace("\n", "")
    for spacing in ("\\!", "\\,", "\\;", "\\:", "\\ ", "\\displaystyle"):
        s = s.replace(spacing, "" if spacing != "\\ " else " ")
    s = s.replace("\\tfrac", "\\frac").replace("\\dfrac", "\\frac")
    s = re.sub(r"\\(?:left|right)(?![a-zA-Z])", "", s)
    s = s.replace("\\{", "{").replace("\\}", "}")  # set braces
    for degree in ("^{\\circ}", "^\\circ", "°"):
        s = s.replace(degree, "")
    s = s.replace("\\$", "").replace("$", "").replace("\\%", "").replace("%", "")
    s = s.strip().rstrip(".").strip()
    unit = _TRAILING_UNIT.match(s)  # "5 \text{ cm}" -> "5"; a lone "\text{(A)}" stays
    if unit:
        s = unit.group(1)
    s = re.sub(_TEXT_COMMAND + r"\{([^{}]*)\}", r"\1", s)
    unit = _WORD_UNIT.match(s)  # "12 apples" -> "12"
    if unit:
        s = unit.group(1)
    s = s.replace(" .", " 0.").replace("{.", "{0.")
    if s.startswith("."):
        s = "0" + s
    lhs, eq, rhs = s.partition("=")  # "x = 5" -> "5", "k=\frac{1}{2}" -> "\frac{1}{2}"
    if eq and "=" not in rhs and len(lhs.strip()) <= 2:
        s = rhs
    s = re.sub(r"\\sqrt([0-9a-zA-Z])", r"\\sqrt{\1}", s)
    s = s.replace(" ", "")
    s = _fix_fracs(s)
    if _THOUSANDS.match(s):
        s = s.replace(",", "")
    if re.fullmatch(r"-?\d+/\d+", s):  # "1/2" -> "\frac{1}{2}"
        sign, (num, den) = ("-" if s[0] == "-" else ""), s.lstrip("-").split("/")
        s = f"{sign}\\frac{{{num}}}{{{den}}}"
    s = re.sub(r"^(-?\d+)\.0+$", r"\1", s)  # "3.00" -> "3"
    return s


# ---------------------------------------------------------------- LaTeX -> sympy

# LaTeX command -> python text; longest names first so that "\pir" reads as "\pi r".
_COMMANDS = {"infty": " oo ", "cdot": "*", "times": "*", "div": "/", "pi": " pi ", "sin": " sin ",
             "cos": " cos ", "tan": " tan ", "log": " log ", "ln": " log ", "exp": " exp "}
_COMMAND_NAMES = sorted(_COMMANDS, key=len, reverse=True)
_NAMES = {"oo", "pi", "sin", "cos", "tan", "log", "exp", "sqrt"}
_MAX_EXPONENT = 1000


class _Unreadable(ValueError):
    pass


def _group(s: str, i: int) -> tuple[str, int]:
    """The braced group (or single character) starting at ``s[i]``, and the index after it."""
    if i >= len(s):
        raise _Unreadable("missing argument")
    if s[i] != "{":
        return s[i], i + 1
    depth = 0
    for j in range(i, len(s)):
        depth += (s[j] == "{") - (s[j] == "}")
        if depth == 0:
            return s[i + 1:j], j + 1
    raise _Unreadable("unbalanced braces")


def _latex_to_python(s: str) -> str:
    out, i = [], 0
    while i < len(s):
        if s.startswith("\\frac", i):
            num, i = _group(s, i + 5)
            den, i = _group(s, i)
            out.append(f"(({_latex_to_python(num)})/({_latex_to_python(den)}))")
        elif s.startswith("\\sqrt", i):
            i += 5
            index = "2"
            if i < len(s) and s[i] == "[":
                end = s.find("]", i)
                if end < 0:
                    raise _Unreadable("unbalanced [")
                index, i = _latex_to_python(s[i + 1:end]), end + 1
            arg, i = _group(s, i)
            out.append(f"(({_latex_to_python(arg)})**(1/({index})))")
        elif s[i] == "\\":
            name = next((n for n in _COMMAND_NAMES if s.startswith(n, i + 1)), None)
            if name is None:
                raise _Unreadable(f"unknown command at {s[i:i + 12]!r}")
            out.append(_COMMANDS[name])
            i += 1 + len(name)
        else:
            out.append({"{": "(", "}": ")", "^": "**"}.get(s[i], s[i]))
            i += 1
    return "".join(out)


def to_sympy(answer: str):
    """A sympy expression for a normalised answer, or None when it cannot be read safely."""
    try:
        text = _latex_to_python(answer)
    except (_Unreadable, RecursionError):
        return None
    # parse_expr evaluates Python: admit only numbers, operators, parentheses, one-letter
    # variables and the few function names above; no attribute access, strings, commas.
    if not re.fullmatch(r"[0-9a-zA-Z+\-*/().\s]*", text) or re.search(r"[a-zA-Z)]\s*\.", text):
        return None
    words = re.findall(r"[a-zA-Z]+", text)
    if any(len(w) > 1 and w not in _NAMES for w in words):
        return None
    import sympy   # loads when a math answer needs it: slow to import, and most rewards never do
    from sympy.parsing.sympy_parser import (implicit_multiplication_application, parse_expr,
                                            standard_transformations)
    symbols = {w: sympy.Symbol(w) for w in words if len(w) == 1}  # "E", "N", "S" stay variables
    try:
        expr = parse_expr(text, local_dict=symbols, evaluate=False,
                          transformations=standard_transformations + (implicit_multiplication_application,))
    except Exception:  # a malformed expression: sympy raises many kinds
        return None
    return expr if _powers_are_small(expr) else None


def _powers_are_small(expr) -> bool:
    """False for a power with a numeric exponent above 1000 in size: 9^{9^{9^{9}}} would keep
    sympy/mpmath multiplying for hours. Children are visited first, so every exponent that is
    evaluated here has only small powers inside."""
    import sympy
    for node in sympy.postorder_traversal(expr):
        if isinstance(node, sympy.Pow) and not node.exp.free_symbols:
            try:
                if not abs(complex(sympy.N(node.exp, 15))) <= _MAX_EXPONENT:
                    return False
            except (TypeError, ValueError, ArithmeticError, OverflowError):
                return False
    return True


def _sympy_equal(a: str, b: str) -> bool:
    ea, eb = to_sympy(a), to_sympy(b)
    if ea is None or eb is None:
        return False
    import sympy
    try:
        if not ea.free_symbols and not eb.free_symbols:
            va, vb = complex(sympy.N(ea, 30)), complex(sympy.N(eb, 30))
            if not (cmath.isfinite(va) and cmath.isfinite(vb)):
                return va == vb  # oo == oo, -oo != oo; nan (0/0) equals nothing
            return abs(va - vb) <= 1e-9 * max(1.0, abs(vb))
        return sympy.simplify(ea - eb) == 0
    except (TypeError, ValueError, ArithmeticError, OverflowError):
        return False


def _split_top_level(s: str) -> tuple[str, list[str], str]:
    """"(1,\\frac{1}{2})" -> ("(", ["1", "\\frac{1}{2}"], ")"): commas outside any bracket."""
    opening, closing = "", ""
    if len(s) >= 2 and s[0] in "([{" and s[-1] in ")]}":
        opening, closing, s = s[0], s[-1], s[1:-1]
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(s):
        depth += (ch in "([{") - (ch in ")]}")
        if ch == "," and depth == 0:
            parts.append(s[start:i])
            start = i + 1
    parts.append(s[start:])
    return opening, parts, closing


def is_equiv(prediction: str, ground_truth: str) -> bool:
    a, b = normalize_answer(prediction), normalize_answer(ground_truth)
    if a.lower() == "nan" or b.lower() == "nan":
        return False  # NaN equals nothing, itself included: a float NaN ground truth is a hole in the data
    if a == b:
        return True
    (oa, pa, ca), (ob, pb, cb) = _split_top_level(a), _split_top_level(b)
    if len(pa) > 1 or len(pb) > 1:
        return (oa, ca) == (ob, cb) and len(pa) == len(pb) and all(
            x == y or _sympy_equal(x, y) for x, y in zip(pa, pb))
    return _sympy_equal(a, b)


def math_score(response: str, ground_truth, **extra) -> dict:
    """1.0 when the last ``\\boxed{}`` of the response equals the ground truth (a bare answer
    or a reference solution with its own ``\\boxed{}``), else 0.0. Metric ``answer_found``."""
    answer = last_boxed(response)
    if answer is None:
        return {"score": 0.0, "answer_found": 0.0}
    truth = str(ground_truth)
    truth = last_boxed(truth) or truth
    return {"score": float(is_equiv(answer, truth)), "answer_found": 1.0}
