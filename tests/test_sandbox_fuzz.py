"""The parsers of what a sandboxed program sends back (``probes.read_report``, ``probes.decode``,
``checker.check``), fuzzed: a seeded corpus of a few thousand inputs (random bytes, mutated valid
reports and values, deep nesting, huge ints, ranges, values of one hash, odd digits and line
breaks). Each call returns, or raises the module's own error (decode: ValueError; read_report and
check: nothing), within a time budget, and the whole run within a memory budget (the process's
peak resident memory, reset first; an address-space limit turns a runaway into MemoryError).
No hypothesis here: the corpus is drawn from random.Random(SEED)."""
import contextlib
import json
import random
import resource
import time

import pytest

from hflow.sandbox.checker import MAX_INT_BITS, ProbeFailed, check
from hflow.sandbox.child import encode
from hflow.sandbox.probes import MAX_DEPTH, decode, plan, read_report

SEED = 44
CALL_SECONDS = 2.0          # the most one call may take (the reward pool's timeout is 10 s a response)
PEAK_BYTES = 768 << 20      # the most the fuzzing may add to the process's resident memory
MERSENNE_61 = 2 ** 61 - 1
TAGS = ["none", "bool", "int", "float", "complex", "str", "bytes", "list", "tuple", "set", "frozenset", "dict",
        "range", "iterator"]
TESTS = ["assert f(1) == 2", "assert set(f(1)) == {1, 2}", "assert sorted(f(1)) == [1, 2]", "assert len(f(1)) == 3",
         "assert abs(f(1) - 1.5) < 1e-9", "assert f(1) in (1, 2)", "assert dict(f(1)) == {1: 2}",
         "assert str(f(1)) == '1'", "assert math.isclose(f(1), 2)", "assert list(f(1)) == [1]",
         "assert f(1)[0] == 1", "assert f(1).startswith('ab')", "assert max(f(1)) == 3", "assert sum(f(1)) == 6",
         "assert frozenset(map(tuple, f(1))) == frozenset()", "assert {v: k for k, v in f(1)} == {}",
         "assert f(1) == f(2)", "assert f'{f(1)}' == 'x'", "assert f(1).count(2) == 1", "assert not f(1)",
         "x, *y = f(1)\nassert y == [2]", "assert all(v > 0 for v in f(1))", "assert f(1) * 2 == [1, 1]",
         "assert hash(f(1)) == 1", "assert {*f(1), *f(2)} == {1}", "assert f(1).get(1) == 2"]


# ---------------------------------------------------------------- the corpus

def plain_value(rng: random.Random, depth: int = 0, nan: bool = True):
    """A random plain value of the kinds the program sends (a NaN among the floats if ``nan``)."""
    kind = rng.choice(["none", "bool", "int", "float", "complex", "str", "bytes", "range"]
                      + (["list", "tuple", "set", "frozenset", "dict"] * 2 if depth < 4 else []))
    small = lambda: [plain_value(rng, depth + 1, nan) for _ in range(rng.randrange(5))]  # noqa: E731
    hashable = lambda: rng.choice([rng.randrange(-9, 9), rng.random(), str(rng.random()), (1, "a")])  # noqa: E731
    return {"none": lambda: None, "bool": lambda: rng.random() < 0.5,
            "int": lambda: rng.choice([0, -1, 2 ** 61 - 1, rng.getrandbits(rng.randrange(1, 300)) - 2 ** 100]),
            "float": lambda: rng.choice([0.1, -0.0, float("inf"), 1e308, 5e-324, rng.random()]
                                        + [float("nan")] * nan),
            "complex": lambda: complex(rng.random(), -rng.random()),
            "str": lambda: "".join(chr(rng.choice([rng.randrange(32, 127), rng.randrange(0x80, 0x10FFFF)]))
                                   for _ in range(rng.randrange(8))).encode("utf-8", "replace").decode("utf-8", "replace"),
            "bytes": lambda: rng.randbytes(rng.randrange(8)),
            "range": lambda: range(rng.randrange(-5, 5), rng.randrange(-5, 50), rng.choice([1, 2, -1, 7])),
            "list": small, "tuple": lambda: tuple(small()),
            "set": lambda: {hashable() for _ in range(rng.randrange(5))},
            "frozenset": lambda: frozenset(hashable() for _ in range(rng.randrange(5))),
            "dict": lambda: {hashable(): plain_value(rng, depth + 1, nan) for _ in range(rng.randrange(4))}}[kind]()


def mutate(rng: random.Random, text: str) -> str:
    """``text`` with a few random edits: characters replaced, cut, doubled, spliced with JSON's
    punctuation, tags and odd characters."""
    pieces = ['"', "[", "]", ",", "{", "}", "0x", "-", "\\u00b2", "\u0663", "\x00", "\n", "\u2028", "\\ud800",
              "1e999", "NaN", *[f'"{tag}"' for tag in TAGS]]
    chars = list(text)
    for _ in range(rng.randrange(1, 6)):
        where = rng.randrange(len(chars) + 1)
        edit = rng.randrange(4)
        if edit == 0 and chars:
            chars[min(where, len(chars) - 1)] = rng.choice(pieces)
        elif edit == 1:
            del chars[where:where + rng.randrange(1, 10)]
        elif edit == 2:
            chars[where:where] = chars[where:where + rng.randrange(1, 20)]
        else:
            chars.insert(where, rng.choice(pieces))
    return "".join(chars)


def hostile_texts(rng: random.Random) -> list[str]:
    """Values built to cost the parent most: depth, length, int size, ranges, one hash."""
    texts = []
    for depth in (MAX_DEPTH - 1, MAX_DEPTH, MAX_DEPTH + 1, 1000, 100_000):
        texts.append('["list", [' * depth + '["none"]' + "]]" * depth)
        texts.append("[" * depth + "]" * depth)
    for digits in (MAX_INT_BITS // 4 - 1, MAX_INT_BITS // 4, MAX_INT_BITS // 4 + 1, MAX_INT_BITS // 4 + 10):
        texts += [json.dumps(["int", "0x" + "f" * digits]), json.dumps(["int", "-0x" + "1" * digits])]
    for stop in (0, 1, 1 << 17, (1 << 17) + 1, 10 ** 18, 2 ** 63, 2 ** 64, -(2 ** 70)):
        for step in ("0x1", "-0x1", "0x0", "0x7"):
            texts.append(json.dumps(["range", "0x0", hex(stop), step]))
    for count in (8, 32, 33, 100, 2000, 16000):
        colliding = [k * MERSENNE_61 for k in range(1, count + 1)]
        texts.append(json.dumps(["set", [["int", hex(v)] for v in colliding]]))
        texts.append(json.dumps(["frozenset", [["tuple", [["int", hex(v)], ["none"]]] for v in colliding]]))
        texts.append(json.dumps(["dict", [[["int", hex(v)], ["int", "0x1"]] for v in colliding]]))
        texts.append(json.dumps(["list", [["int", hex(v)] for v in colliding]]))
    for _ in range(20):
        texts.append(json.dumps(["list", [["none"]] * rng.choice([1 << 17, (1 << 17) + 1, 300_000])]))
        texts.append(json.dumps(["bytes", "ab" * rng.randrange(1, 1 << 19) + rng.choice(["", "a", "zz"])]))
        texts.append(json.dumps(["str", "\udc80" * rng.randrange(1, 1 << 16)]))
        texts.append(json.dumps(["float", rng.choice(["0x1p99999", "inf", "-0x0p+0", "0x" + "f" * 41, "nan"])]))
    return texts


def decode_corpus(rng: random.Random) -> list[str]:
    corpus = [rng.randbytes(rng.randrange(1, 200)).decode("latin-1") for _ in range(500)]
    valid = [json.dumps(encode(plain_value(rng))) for _ in range(700)]
    corpus += valid + [mutate(rng, rng.choice(valid)) for _ in range(1500)]
    return corpus + hostile_texts(rng)


def report_corpus(rng: random.Random, values: list[str]) -> list[tuple[str, int]]:
    """Report texts (lines, valid and not, with odd digits and every line break) and probe counts."""
    def line():
        index = rng.choice(["0", "1", "7", "\u00b2", "\u0663", "01", "-1", "", " ", "9" * 30, "9" * 5000, "1.0"])
        return rng.choice([
            "ran", f"done {index}", f"value {index} {rng.choice(values)}", f"raised {index} ValueError",
            f"error {mutate(rng, 'ZeroDivisionError: x')}", mutate(rng, f"value {index} []"),
            rng.randbytes(rng.randrange(40)).decode("latin-1"), "value 0 " + rng.choice(values) * 2])
    breaks = ["\n", "\r\n", "\r", "\x0b", "\x1c", "\u2028", "\x00"]
    corpus = []
    for _ in range(1200):
        lines = [line() for _ in range(rng.randrange(1, 12))]
        corpus.append(("".join(text + rng.choice(breaks) for text in lines), rng.randrange(0, 9)))
    return corpus


# ---------------------------------------------------------------- the run

@contextlib.contextmanager
def bounded(peak_bytes: int):
    """This process's address space may grow by ``peak_bytes`` meanwhile (a runaway is MemoryError,
    not the machine's memory), its peak resident memory reset first; yields a function that
    returns how much the peak grew."""
    with open("/proc/self/status") as f:
        status = dict(line.split(":", 1) for line in f)
    size, resident = (int(status[key].split()[0]) << 10 for key in ("VmSize", "VmRSS"))
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (size + 2 * peak_bytes, hard))

    def growth() -> int:
        with open("/proc/self/status") as f:
            peak = next(int(line.split()[1]) << 10 for line in f if line.startswith("VmHWM:"))
        return peak - resident
    try:
        yield growth
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


class Calls:
    """Each call timed; what it raised beyond what it may, kept."""

    def __init__(self):
        self.count, self.slowest, self.failures = 0, (0.0, None), []

    def __call__(self, what: str, function, *args, allowed=()):
        self.count += 1
        start = time.perf_counter()
        try:
            result = function(*args)
        except allowed:
            result = None
        except Exception as e:  # noqa: BLE001 - what the fuzzing is looking for
            self.failures.append((what, f"{type(e).__name__}: {e}"[:200], repr(args)[:200]))
            result = None
        elapsed = time.perf_counter() - start
        if elapsed > self.slowest[0]:
            self.slowest = (elapsed, f"{what} {repr(args)[:120]}")
        return result


@pytest.mark.timeout(300)
def test_the_parsers_take_any_input_within_their_budgets():
    rng = random.Random(SEED)
    texts = decode_corpus(rng)
    reports = report_corpus(rng, [t for t in texts if len(t) < 2000])
    plans = [plan(test) for test in TESTS]
    calls = Calls()
    start = time.monotonic()
    with bounded(PEAK_BYTES) as growth:
        decoded = []
        for text in texts:
            value = calls("decode", decode, text, allowed=ValueError)
            if value is not None:
                decoded.append(value)
        for text, probes in reports:
            report = calls("read_report", read_report, text, probes)
            if report is not None:  # else a failure, kept
                assert len(report.values) == probes and all(isinstance(i, int) for i in report.done)
        values = decoded + [ProbeFailed("raised")] * 20
        for _ in range(1500):
            test = rng.choice(plans)
            arguments = [rng.choice(values) for _ in test.probes]
            verdict = calls("check", check, test, [iter(list(v)) if isinstance(v, type(iter([]))) else v
                                                   for v in arguments])
            assert verdict in (True, False)
        peak = growth()
    seconds = time.monotonic() - start
    print(f"fuzzed {calls.count} calls ({len(texts)} values, {len(reports)} reports, 1500 checks) in {seconds:.1f} s; "
          f"slowest {calls.slowest[0]:.2f} s ({calls.slowest[1]}); peak +{peak >> 20} MiB")
    assert calls.failures == []
    assert calls.slowest[0] < CALL_SECONDS, calls.slowest
    assert peak < PEAK_BYTES


def test_plain_values_round_trip_through_the_encoding():
    rng = random.Random(SEED + 1)
    for _ in range(2000):
        value = plain_value(rng, nan=False)  # NaN is not equal to itself: test_code_reward.py sends one
        decoded = decode(json.dumps(encode(value)))
        assert type(decoded) is type(value) and decoded == value
