"""The interpreter that checks a sandboxed program's tests here, on the values the program
sent back (``probes`` splits a test; ``hflow.sandbox`` gives the trust model).

It evaluates a test's syntax tree, with each probe replaced by its value: the names it knows are
the built-ins below and ``math``/``cmath`` (their numeric functions), attributes are read only
when public (no ``_``), and a lambda or comprehension of the test's own runs here too. The values
are plain data the solution chose, so what it bounds is their cost: ints, repetitions, ranges and
steps, values of one hash in a set or dict (``MAX_*``), and, where the check runs alone in its
process (a reward worker), the memory it may take; what those miss (``sum(f(x), [])`` on a long
list) the reward pool's timeout ends.
"""
import ast
import builtins
import cmath
import contextlib
import itertools
import math
import operator
import resource
from types import ModuleType

MAX_INT_BITS = 1 << 20      # an int a value or an operation here may have
MAX_ITEMS = 1 << 20         # the items an operation here may make
MAX_STEPS = 1 << 18         # syntax-tree nodes evaluated per test
MAX_SHARED_HASH = 32        # distinct values of one hash a set or dict here may hold
MAX_CHECK_MEMORY = 2 << 30  # bytes of address space a check may add, where it runs alone in its process

BUILTINS = ("abs all any ascii bin bool bytes callable chr complex dict divmod enumerate filter float "
            "format frozenset hash hex int isinstance issubclass iter len list map max min next oct ord "
            "pow range repr reversed round set slice sorted str sum tuple type zip").split()
MODULES = {"math": math, "cmath": cmath}
MODULE_NAMES = {
    math: set("pi e tau inf nan isclose isnan isinf isfinite sqrt isqrt floor ceil trunc fabs fmod copysign "
              "gcd lcm log log2 log10 log1p exp expm1 pow hypot dist fsum sin cos tan asin acos atan atan2 sinh "
              "cosh tanh asinh acosh atanh degrees radians modf frexp remainder erf erfc".split()),
    cmath: set("pi e tau inf nan infj nanj isclose isnan isinf isfinite sqrt exp log log10 phase polar rect sin "
               "cos tan asin acos atan sinh cosh tanh asinh acosh atanh".split()),
}
_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
           ast.LShift: operator.lshift, ast.RShift: operator.rshift, ast.BitOr: operator.or_,
           ast.BitXor: operator.xor, ast.BitAnd: operator.and_}
_UNARY = {ast.Not: operator.not_, ast.USub: operator.neg, ast.UAdd: operator.pos, ast.Invert: operator.invert}
_COMPARE = {ast.Eq: operator.eq, ast.NotEq: operator.ne, ast.Lt: operator.lt, ast.LtE: operator.le,
            ast.Gt: operator.gt, ast.GtE: operator.ge, ast.Is: operator.is_, ast.IsNot: operator.is_not,
            ast.In: lambda a, b: a in b, ast.NotIn: lambda a, b: a not in b}
COMPREHENSIONS = (ast.ListComp, ast.SetComp, ast.GeneratorExp, ast.DictComp)
# What the interpreter evaluates (besides operators, contexts and the comprehension and
# argument records these hold)
EVALUATED = (ast.Constant, ast.Name, ast.Tuple, ast.List, ast.Set, ast.Dict, ast.BinOp, ast.UnaryOp,
             ast.BoolOp, ast.Compare, ast.IfExp, ast.Call, ast.Attribute, ast.Subscript, ast.Slice,
             ast.Starred, ast.JoinedStr, ast.FormattedValue, ast.Lambda, *COMPREHENSIONS)
RECORDS = (ast.expr_context, ast.operator, ast.unaryop, ast.boolop, ast.cmpop, ast.keyword,
           ast.comprehension, ast.arguments, ast.arg)


class ProbeValue(ast.expr):
    _fields = ("index",)


class ProbeFailed(Exception):
    """A probe raised, sent no value, or a value that is not plain data."""


class Untrusted(ValueError):
    """A test that cannot be checked without trusting the solution's process."""


def imports(node) -> list[tuple[str, object]]:
    """(name, object) that an import of ``math`` or ``cmath`` binds; Untrusted for another."""
    if isinstance(node, ast.Import):
        pairs = [(alias.asname or alias.name, MODULES.get(alias.name)) for alias in node.names]
    else:
        module = MODULES.get(node.module) if node.level == 0 else None
        pairs = [(alias.asname or alias.name, getattr(module, alias.name)
                  if module and alias.name in MODULE_NAMES[module] else None) for alias in node.names]
    if any(obj is None for _, obj in pairs):
        raise Untrusted(f"{ast.unparse(node)} (only math and cmath, and of them their numeric functions)")
    return pairs


def check(test, values: list) -> bool:
    """Whether ``test`` (a ``probes.Plan``) passes with its probes' ``values`` (a ProbeFailed
    stands for a failed one)."""
    if test.broken is not None:
        return False
    try:
        with _bounded_memory():
            _Checker(values).run(test.statements)
        return True
    except Exception:  # an assert that fails, a probe that failed, anything the test raises; MemoryError
        return False


@contextlib.contextmanager
def _bounded_memory():
    """The address space may grow by MAX_CHECK_MEMORY meanwhile (RLIMIT_AS), where this process has
    one thread (a reward worker): a size the solution chose where the limits above do not look
    (``f(x).zfill(f(y))``, a format width) is then a MemoryError, not the machine's memory. With
    other threads the limit would be theirs too: none is set."""
    limit = _address_space_limit()
    if limit is None:
        yield
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


def _address_space_limit():
    """This process's address space now plus MAX_CHECK_MEMORY, unless it has other threads or a
    lower limit already."""
    try:
        with open("/proc/self/status", "rb") as f:
            fields = dict(line.split(b":", 1) for line in f.read().splitlines() if b":" in line)
        threads, size = int(fields[b"Threads"]), int(fields[b"VmSize"].split()[0]) * 1024
    except (OSError, KeyError, ValueError, IndexError):  # not Linux, or a kernel thread's status
        return None
    limit = size + MAX_CHECK_MEMORY
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    if threads != 1 or soft != resource.RLIM_INFINITY and soft <= limit \
            or hard != resource.RLIM_INFINITY and hard < limit:
        return None
    return limit


def _guard_size(result_items: int, what: str) -> None:
    if result_items > MAX_ITEMS:
        raise OverflowError(f"{what} too big for the checker")


def guard_hashes(keys) -> None:
    """OverflowError when more than MAX_SHARED_HASH distinct ``keys`` share a hash: a set or dict of
    them takes quadratic time to build (ints that are multiples of 2**61 - 1 all hash to 0; 16k
    of them, 2.5 s). Linear: each key meets at most MAX_SHARED_HASH others of its hash."""
    buckets = {}
    for key in keys:
        try:
            code = hash(key)
        except TypeError:
            continue  # unhashable: the set or dict made of it raises
        bucket = buckets.get(code)
        if bucket is None:
            bucket = buckets[code] = set()
        bucket.add(key)
        if len(bucket) > MAX_SHARED_HASH:
            raise OverflowError(f"more than {MAX_SHARED_HASH} values of one hash")


_HASHED = (set, frozenset, dict)
# Methods of sets and dicts that hash the items of iterables they are given: all their
# positional arguments, or (ONE_ITERABLE) only the first
_HASHING_METHODS = {"union", "intersection", "difference", "symmetric_difference", "issubset", "issuperset",
                    "isdisjoint", "update", "intersection_update", "difference_update",
                    "symmetric_difference_update", "fromkeys"}
_ONE_ITERABLE = {"fromkeys"}


def _hashing(function) -> bool:
    """Whether calling ``function`` makes a set or dict of its arguments' items (``set(x)``,
    ``dict(pairs)``, ``s.union(x)``, ``set.union(s, x)``, ``dict.fromkeys(x)``)."""
    if any(function is kind for kind in _HASHED):
        return True
    owner = getattr(function, "__self__", getattr(function, "__objclass__", None))
    owned = isinstance(owner, _HASHED) or any(owner is kind for kind in _HASHED)
    return owned and getattr(function, "__name__", None) in _HASHING_METHODS


def _hash_checked_arguments(function, args: list) -> list:
    """The arguments of a ``_hashing`` call, iterables read into lists (at most MAX_ITEMS items),
    once the keys that the set or dict it makes may hold, its owner's included, were checked
    (``guard_hashes``). The same call on them does what it would have done on ``args``."""
    name = getattr(function, "__name__", None)
    owner = getattr(function, "__self__", None)
    pairs = function is dict or isinstance(owner, dict) and name == "update"
    iterables = 1 if any(function is kind for kind in _HASHED) or pairs or name in _ONE_ITERABLE else len(args)
    checked, keys = [], [owner] if isinstance(owner, _HASHED) else []
    for arg in args[:iterables]:
        if not isinstance(arg, _HASHED):  # a set or dict: its keys were checked when it was made
            arg = list(itertools.islice(arg, MAX_ITEMS + 1))
            _guard_size(len(arg), "a set or dict")
            if pairs:  # dict() takes any two-item iterable as a pair; a tuple of it reads the same
                arg = [tuple(itertools.islice(pair, 3)) for pair in arg]
        checked.append(arg)
        keys.append([pair[0] for pair in arg if pair] if pairs and not isinstance(arg, dict) else arg)
    guard_hashes(itertools.chain.from_iterable(keys))
    return checked + list(args[iterables:])


def _guarded_binary(op, left, right):
    """``op(left, right)``, unless it would make an int or a sequence too big for the checker."""
    if isinstance(left, int) and isinstance(right, int):
        bits = {operator.pow: lambda: abs(left).bit_length() * right if right > 0 and abs(left) > 1 else 0,
                operator.lshift: lambda: abs(left).bit_length() + right,
                operator.mul: lambda: abs(left).bit_length() + abs(right).bit_length()}.get(op, lambda: 0)()
        if bits > MAX_INT_BITS:
            raise OverflowError("an int too big for the checker")
    elif op is operator.mul:
        for seq, times in ((left, right), (right, left)):
            if isinstance(seq, (str, bytes, list, tuple)) and isinstance(times, int):
                _guard_size(len(seq) * times, "a repetition")
    return op(left, right)


def _guarded_pow(base, exponent, modulo=None):
    return pow(base, exponent, modulo) if modulo is not None else _guarded_binary(operator.pow, base, exponent)


def _guarded_range(*args):
    numbers = range(*args)
    _guard_size(len(numbers), "a range")
    return numbers


def _guarded_bytes(source=b"", *args):
    if isinstance(source, int):
        _guard_size(source, "a bytes object")
    return bytes(source, *args)


def _type_of(obj):
    return type(obj)  # one argument only: type(name, bases, dict) would make a class


_SAFE = {name: getattr(builtins, name) for name in BUILTINS}
_SAFE.update(MODULES, pow=_guarded_pow, range=_guarded_range, bytes=_guarded_bytes, type=_type_of)


class _Checker:
    def __init__(self, values: list):
        self.values = values
        self.names = dict(_SAFE)
        self.steps = 0

    def run(self, statements) -> None:
        for node in statements:
            if isinstance(node, ast.Assert):
                if not self.expr(node.test, {}):
                    raise AssertionError
            elif isinstance(node, ast.Expr):
                self.expr(node.value, {})
            elif isinstance(node, ast.Assign):
                value = self.expr(node.value, {})
                for target in node.targets:
                    self._bind(target, value, self.names)
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                self.names.update(imports(node))

    def _bind(self, target, value, scope: dict) -> None:
        if isinstance(target, ast.Name):
            scope[target.id] = value
            return
        items = list(value)
        _guard_size(len(items), "an unpacking")
        starred = [i for i, t in enumerate(target.elts) if isinstance(t, ast.Starred)]
        if not starred and len(items) != len(target.elts):
            raise ValueError("wrong number of values to unpack")
        star = starred[0] if starred else len(target.elts)
        after = len(target.elts) - star - 1
        for sub, item in zip(target.elts[:star], items):
            self._bind(sub, item, scope)
        if starred:
            self._bind(target.elts[star].value, items[star:len(items) - after], scope)
            for sub, item in zip(target.elts[star + 1:], items[len(items) - after:]):
                self._bind(sub, item, scope)

    def expr(self, node, scope: dict):
        self.steps += 1
        if self.steps > MAX_STEPS:
            raise OverflowError("the test takes too many steps for the checker")
        return getattr(self, f"_{type(node).__name__}")(node, scope)

    def _ProbeValue(self, node, scope):
        value = self.values[node.index]
        if isinstance(value, ProbeFailed):
            raise value
        return value

    def _Constant(self, node, scope):
        return node.value

    def _Name(self, node, scope):
        if node.id in scope:
            return scope[node.id]
        return self.names[node.id]

    def _items(self, elements, scope) -> list:
        items = []
        for element in elements:
            if isinstance(element, ast.Starred):
                items.extend(self.expr(element.value, scope))
            else:
                items.append(self.expr(element, scope))
            _guard_size(len(items), "a display")
        return items

    def _Tuple(self, node, scope):
        return tuple(self._items(node.elts, scope))

    def _List(self, node, scope):
        return self._items(node.elts, scope)

    def _Set(self, node, scope):
        items = self._items(node.elts, scope)
        guard_hashes(items)
        return set(items)

    def _Dict(self, node, scope):
        pairs = []
        for key, value in zip(node.keys, node.values):
            if key is None:
                mapping = self.expr(value, scope)
                if not isinstance(mapping, dict):
                    raise TypeError(f"{type(mapping).__name__} is not a mapping")
                pairs.extend(mapping.items())
            else:
                pairs.append((self.expr(key, scope), self.expr(value, scope)))
            _guard_size(len(pairs), "a display")
        guard_hashes(key for key, _ in pairs)
        return dict(pairs)

    def _BinOp(self, node, scope):
        return _guarded_binary(_BINARY[type(node.op)], self.expr(node.left, scope), self.expr(node.right, scope))

    def _UnaryOp(self, node, scope):
        return _UNARY[type(node.op)](self.expr(node.operand, scope))

    def _BoolOp(self, node, scope):
        result = None
        for value in node.values:
            result = self.expr(value, scope)
            if bool(result) != isinstance(node.op, ast.And):
                return result
        return result

    def _Compare(self, node, scope):
        left = self.expr(node.left, scope)
        for op, comparator in zip(node.ops, node.comparators):
            right = self.expr(comparator, scope)
            if not _COMPARE[type(op)](left, right):
                return False
            left = right
        return True

    def _IfExp(self, node, scope):
        return self.expr(node.body if self.expr(node.test, scope) else node.orelse, scope)

    def _Call(self, node, scope):
        function = self.expr(node.func, scope)
        args = self._items(node.args, scope)
        kwargs = {}
        for keyword in node.keywords:
            value = self.expr(keyword.value, scope)
            kwargs.update(value if keyword.arg is None else {keyword.arg: value})
        if _hashing(function):
            args = _hash_checked_arguments(function, args)
        return function(*args, **kwargs)

    def _Attribute(self, node, scope):
        obj = self.expr(node.value, scope)
        if node.attr.startswith("_"):
            raise AttributeError(f"{node.attr}: not for the checker")
        if isinstance(obj, ModuleType) and node.attr not in MODULE_NAMES.get(obj, ()):
            raise AttributeError(f"{node.attr}: not for the checker")
        return getattr(obj, node.attr)

    def _Subscript(self, node, scope):
        return self.expr(node.value, scope)[self.expr(node.slice, scope)]

    def _Slice(self, node, scope):
        part = lambda p: None if p is None else self.expr(p, scope)  # noqa: E731
        return slice(part(node.lower), part(node.upper), part(node.step))

    def _JoinedStr(self, node, scope):
        return "".join(str(self.expr(value, scope)) for value in node.values)

    def _FormattedValue(self, node, scope):
        value = self.expr(node.value, scope)
        value = {115: str, 114: repr, 97: ascii}.get(node.conversion, lambda v: v)(value)
        return format(value, self.expr(node.format_spec, scope) if node.format_spec else "")

    def _Lambda(self, node, scope):
        args = node.args
        if args.posonlyargs or args.vararg or args.kwonlyargs or args.kwarg:
            raise TypeError("the checker's lambdas take plain parameters only")
        names = [a.arg for a in args.args]
        defaults = [self.expr(d, scope) for d in args.defaults]

        def function(*values):
            missing = len(names) - len(values)
            if not 0 <= missing <= len(defaults):
                raise TypeError("wrong number of arguments")
            bound = dict(zip(names, [*values, *defaults[len(defaults) - missing:]]))
            return self.expr(node.body, {**scope, **bound})
        return function

    def _generate(self, node, generators, scope):
        first, rest = generators[0], generators[1:]
        for item in self.expr(first.iter, scope):
            inner = dict(scope)
            self._bind(first.target, item, inner)
            if all(self.expr(condition, inner) for condition in first.ifs):
                if rest:
                    yield from self._generate(node, rest, inner)
                elif isinstance(node, ast.DictComp):
                    yield self.expr(node.key, inner), self.expr(node.value, inner)
                else:
                    yield self.expr(node.elt, inner)

    def _ListComp(self, node, scope):
        return list(self._generate(node, node.generators, scope))

    def _SetComp(self, node, scope):
        items = list(self._generate(node, node.generators, scope))
        guard_hashes(items)
        return set(items)

    def _DictComp(self, node, scope):
        pairs = list(self._generate(node, node.generators, scope))
        guard_hashes(key for key, _ in pairs)
        return dict(pairs)

    def _GeneratorExp(self, node, scope):
        return self._generate(node, node.generators, scope)
