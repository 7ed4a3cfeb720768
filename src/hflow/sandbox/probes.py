"""A sandboxed program's tests, checked where the solution cannot reach them (``hflow.sandbox``
gives the trust model).

A test is split into *probes*, the sub-expressions that call into the solution (``f(2)`` in
``assert f(2) == 4``), and the rest. Only the probes go to the sandboxed program, which sends
back their values as plain data (``decode``); the rest (the comparison, ``abs(x - 1.5) < 1e-9``,
``set(x) == {1, 2}``, ``math.isclose(...)``) is evaluated here, by a small interpreter of
Python's syntax tree (``checker``), on those values. So the expected values never enter the
solution's process, and what it sends can be nothing but values: no object of its own, no
``__eq__`` of its own, no verdict.

A probe is a name the test does not define (nor a built-in or ``math``/``cmath``), a call of
something built from one, or an attribute of one: the biggest such piece, arguments included,
except that items are taken here (``f(x)[k]`` sends ``f(x)``), and so are the methods the
built-in types have (``startswith``, ``count``, ``get``...), called on the value, so that their
arguments (``f(x).startswith(expected)``) stay here (a solution object's own method of such a
name is not reached: that test fails). The expected values can still reach the solution where
a test hands them to it (``check(f(x), expected)``). A test the split cannot cover (``plan``
raises ``Untrusted``) is not run at all: a loop, a ``def``, a call into the solution that takes
a value the test computed (``[f(i) for i in range(3)]``), a construct the interpreter does not
know. It fails, and ``code_score`` counts it.
"""
import ast
import copy
import json
import re
import sys
from dataclasses import dataclass, field
from typing import Optional

from hflow.sandbox.checker import (BUILTINS, COMPREHENSIONS, EVALUATED, MAX_INT_BITS, MODULES, RECORDS,
                                   ProbeFailed, ProbeValue, Untrusted, guard_hashes, imports)

MAX_DEPTH = 64              # nesting of a decoded value
MAX_VALUE_NODES = 1 << 17   # items of one decoded value (a range counts its length)
PLAIN_METHODS = {name for kind in (str, bytes, list, tuple, dict, set, frozenset, int, float, complex)
                 for name in dir(kind) if not name.startswith("_")}


@dataclass
class Probe:
    source: str
    """An expression to evaluate in the solution's namespace (or, mode "exec", an import)."""
    keep: bool = True
    """Whether its value matters (else only whether it raised)."""
    mode: str = "eval"


@dataclass
class Plan:
    """One test: its statements, each probe replaced by a ``ProbeValue``, and its probes."""
    statements: list
    probes: list[Probe] = field(default_factory=list)
    broken: Optional[str] = None
    """Why it fails whatever the solution (a syntax error)."""


def _bound_names(target) -> set[str]:
    if isinstance(target, ast.Name):
        return {target.id}
    if isinstance(target, (ast.Tuple, ast.List)):
        return set().union(*map(_bound_names, target.elts)) if target.elts else set()
    if isinstance(target, ast.Starred):
        return _bound_names(target.value)
    raise Untrusted(f"assigning to {type(target).__name__}")


def free_names(node, bound: frozenset = frozenset()) -> set[str]:
    """The names ``node`` reads that it does not bind itself (lambda parameters, comprehension targets)."""
    if isinstance(node, ast.Name):
        return set() if node.id in bound else {node.id}
    if isinstance(node, ast.Lambda):
        args = node.args
        params = {a.arg for a in args.posonlyargs + args.args + args.kwonlyargs}
        params |= {a.arg for a in (args.vararg, args.kwarg) if a}
        defaults = set().union(*(free_names(d, bound) for d in args.defaults + args.kw_defaults if d))
        return defaults | free_names(node.body, bound | params)
    if isinstance(node, COMPREHENSIONS):
        names, inner = set(), bound
        for generator in node.generators:
            names |= free_names(generator.iter, inner)
            inner = inner | _bound_names(generator.target)
            for condition in generator.ifs:
                names |= free_names(condition, inner)
        parts = [node.key, node.value] if isinstance(node, ast.DictComp) else [node.elt]
        return names.union(*(free_names(part, inner) for part in parts))
    return set().union(*(free_names(child, bound) for child in ast.iter_child_nodes(node)))


class _Planner:
    def __init__(self):
        self.probes: list[Probe] = []
        self.local: set[str] = set()  # names the test binds, or imports

    def solution_names(self, node) -> set[str]:
        return free_names(node) - set(BUILTINS) - set(MODULES) - self.local

    def statement(self, node):
        if isinstance(node, ast.Assert):
            return ast.Assert(test=self.expr(node.test), msg=None)
        if isinstance(node, ast.Expr):
            value = self.expr(node.value)
            if isinstance(value, ProbeValue):  # `f(0)`: passes unless it raises, whatever it returns
                self.probes[value.index].keep = False
            return ast.Expr(value)
        if isinstance(node, ast.Assign):
            value = self.expr(node.value)
            self.local |= set().union(*map(_bound_names, node.targets))
            return ast.Assign(targets=node.targets, value=value)
        if isinstance(node, ast.Pass):
            return node
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            for name, _ in imports(node):  # the solution's namespace gets them too, for the probes
                self.local.add(name)
            self.probes.append(Probe(ast.unparse(node), keep=False, mode="exec"))
            return node
        raise Untrusted(f"a {type(node).__name__} statement")

    def expr(self, node):
        if not self.solution_names(node):
            unknown = [type(n).__name__ for n in ast.walk(node) if not isinstance(n, EVALUATED + RECORDS)]
            if unknown:
                raise Untrusted(f"{unknown[0]} is not supported by the checker")
            return node
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in PLAIN_METHODS:
            # `f(x).startswith("ab")`: a built-in type's method, called here on the value, so that
            # its arguments (often the expected value) stay here
            planned = copy.copy(node)
            planned.func = copy.copy(node.func)
            planned.func.value = self.expr(node.func.value)
            planned.args = [self._child(arg) for arg in node.args]
            planned.keywords = [self._child(keyword) for keyword in node.keywords]
            return planned
        if self._is_access(node):
            if free_names(node) & self.local:
                raise Untrusted("a call into the solution takes a value the test computed")
            return self._probe(node, keep=True)
        if isinstance(node, COMPREHENSIONS):  # its first iterable is evaluated outside it: a probe may be
            planned = copy.copy(node)
            planned.generators = [copy.copy(node.generators[0]), *node.generators[1:]]
            planned.generators[0].iter = self.expr(node.generators[0].iter)
            rest = copy.copy(planned)
            rest.generators = [copy.copy(planned.generators[0]), *planned.generators[1:]]
            rest.generators[0].iter = ast.Constant(value=())
            if self.solution_names(rest):
                raise Untrusted("a call into the solution inside a comprehension")
            self.expr(rest)  # what the checker evaluates of it must be supported
            return planned
        if not isinstance(node, EVALUATED) or isinstance(node, ast.Lambda):
            raise Untrusted(f"{type(node).__name__} over the solution's values")
        planned = copy.copy(node)
        for name, value in ast.iter_fields(node):
            if isinstance(value, ast.expr):
                setattr(planned, name, self.expr(value))
            elif isinstance(value, list):
                setattr(planned, name, [self._child(item) for item in value])
        return planned

    def _child(self, item):
        if isinstance(item, ast.expr):
            return self.expr(item)
        if isinstance(item, ast.keyword):
            return ast.keyword(arg=item.arg, value=self.expr(item.value))
        return item  # None (a ** in a dict display), an operator

    def _is_access(self, node) -> bool:
        """A name of the solution's, a call of one, or its attribute: the solution's own. (An item
        of one is taken here, from the value: ``f(x)[k]`` sends ``f(x)``, not ``k``.)"""
        if isinstance(node, ast.Name):
            return True
        if isinstance(node, ast.Call):
            return bool(self.solution_names(node.func))
        if isinstance(node, ast.Attribute):
            return bool(self.solution_names(node.value))
        return False

    def _probe(self, node, keep: bool) -> ProbeValue:
        self.probes.append(Probe(ast.unparse(node), keep))
        return ProbeValue(index=len(self.probes) - 1)


def plan(test: str) -> Plan:
    """Split one test into probes and what this module evaluates; Untrusted if it cannot be."""
    try:
        tree = ast.parse(test, "<test>", "exec")
    except (SyntaxError, ValueError, RecursionError, MemoryError) as e:
        return Plan([], broken=f"{type(e).__name__}: {e}")
    planner = _Planner()
    try:
        statements = [planner.statement(node) for node in tree.body]
    except RecursionError:
        raise Untrusted("nested too deeply for the checker") from None
    return Plan(statements, planner.probes)


# ---------------------------------------------------------------- values sent back

def decode(text: str):
    """The plain value the program encoded (``child.encode``); ValueError unless well formed and
    within the limits above (and the checker's on ints and values of one hash)."""
    try:
        return _decode(json.loads(text), 0, [MAX_VALUE_NODES])
    except (TypeError, ValueError, RecursionError, OverflowError, MemoryError) as e:  # TypeError: an unhashable key
        raise ValueError(f"not a plain value: {e}") from None


def _decode(data, depth: int, budget: list):
    budget[0] -= 1
    if depth > MAX_DEPTH or budget[0] < 0 or not isinstance(data, list) or not data or not isinstance(data[0], str):
        raise ValueError("not an encoded value, or too big")
    tag, payload = data[0], data[1:]
    items = lambda: [_decode(item, depth + 1, budget) for item in _one(payload, list)]  # noqa: E731
    if tag == "none" and not payload:
        return None
    if tag == "bool":
        return bool(_one(payload, bool))
    if tag == "int":
        return _int(_one(payload, str))
    if tag == "float":
        return float.fromhex(_short(_one(payload, str)))
    if tag == "complex" and len(payload) == 2:
        return complex(float.fromhex(_short(payload[0])), float.fromhex(_short(payload[1])))
    if tag == "str":
        return _one(payload, str)
    if tag == "bytes":
        return bytes.fromhex(_one(payload, str))
    if tag in ("list", "tuple", "iterator"):
        return {"list": list, "tuple": tuple, "iterator": iter}[tag](items())
    if tag in ("set", "frozenset"):
        values = items()
        guard_hashes(values)  # before the set is built: distinct values of one hash take quadratic time
        return (set if tag == "set" else frozenset)(values)
    if tag == "dict":
        pairs = []
        for pair in _one(payload, list):
            if not isinstance(pair, list) or len(pair) != 2:
                raise ValueError("a dict item is not a pair")
            pairs.append((_decode(pair[0], depth + 1, budget), _decode(pair[1], depth + 1, budget)))
        guard_hashes(key for key, _ in pairs)
        return dict(pairs)
    if tag == "range" and len(payload) == 3:
        numbers = range(*(_int(_short(part)) for part in payload))
        budget[0] -= _length(numbers)  # three ints stand for any length: it costs its items, as a list would
        if budget[0] < 0:
            raise ValueError("too big a range")
        return numbers
    raise ValueError(f"unknown value tag {tag!r}")


def _length(numbers: range) -> int:
    try:
        return len(numbers)
    except OverflowError:  # longer than sys.maxsize
        return sys.maxsize


def _one(payload: list, kind: type):
    if len(payload) != 1 or type(payload[0]) is not kind:
        raise ValueError("malformed value")
    return payload[0]


def _short(text) -> str:
    if not isinstance(text, str) or len(text) > 40:
        raise ValueError("malformed number")
    return text


def _int(text: str) -> int:
    if not re.fullmatch(r"-?0x[0-9a-f]+", text) or len(text) > MAX_INT_BITS // 4 + 3:
        raise ValueError("malformed or too big an int")
    return int(text, 16)


@dataclass
class Report:
    """What the program wrote to its result file, read as the solution's word: values only."""
    ran: bool = False
    """The solution's code ran to its end (else every test fails)."""
    error: Optional[str] = None
    """Why the solution itself failed, as the program put it."""
    values: list = field(default_factory=list)
    """Per probe, its decoded value, or a ProbeFailed."""
    done: set = field(default_factory=set)
    """The tests whose probes all came back (a program stopped midway leaves the rest out)."""


def read_report(text: str, num_probes: int) -> Report:
    """The program's result file read; never raises: a line it cannot read is left out, a value it
    cannot decode is a ProbeFailed."""
    report = Report(values=[ProbeFailed("no value")] * num_probes)
    seen = set()
    for line in text.splitlines():
        kind, _, rest = line.partition(" ")
        word, _, detail = rest.partition(" ")
        index = ascii_number(word)
        if kind == "ran":
            report.ran = True
        elif kind == "error" and report.error is None:
            report.error = rest
        elif kind == "done" and index is not None:
            report.done.add(index)
        elif kind in ("value", "raised") and index is not None and index < num_probes and index not in seen:
            seen.add(index)
            try:
                report.values[index] = decode(detail) if kind == "value" else ProbeFailed(detail)
            except ValueError as e:
                report.values[index] = ProbeFailed(str(e))
    return report


def ascii_number(word: str) -> Optional[int]:
    """``word`` as a number (an index, a wait status), if it is one: ASCII digits only
    (``str.isdigit`` takes "\u00b2", which ``int`` refuses, and ``int`` takes other scripts'
    digits), and few enough that ``int`` takes them (Python refuses over 4,300)."""
    if word.isascii() and word.isdigit() and len(word) <= 18:
        return int(word)
    return None
