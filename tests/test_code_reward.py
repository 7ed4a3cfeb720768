"""The code reward: its score on right, wrong and partly right code, the split of tests into probes
and their check outside the solution's process, batch scoring in the reward pool, and the
built-in code task (its reference solutions pass its asserts). The sandbox itself:
test_code_sandbox.py."""
import json
import subprocess
import sys
import textwrap
import time

import pytest

from hflow.rewards import get_reward_fn, score_batch
from hflow.rewards.code import code_score, extract_code, parse_tests
from hflow.sandbox import run_tests
from hflow.sandbox.checker import ProbeFailed, Untrusted, check
from hflow.sandbox.child import encode
from hflow.sandbox.probes import decode, plan, read_report
from test_code_sandbox import HONEST, sandbox_processes


# ---------------------------------------------------------------- response and tests

@pytest.mark.parametrize("response, code", [
    ("def f(x):\n    return x\n", "def f(x):\n    return x\n"),
    ("Here:\n```python\ndef f(x):\n    return x\n```\nDone.", "def f(x):\n    return x\n"),
    ("```py\nA = 1\n```", "A = 1\n"),
    ("```\nA = 1\n```", "A = 1\n"),
    ("First:\n```python\nA = 1\n```\nBetter:\n```python\nA = 2\n```", "A = 2\n"),  # the last block
    ("```python\nA = 1\nB = 2", "A = 1\nB = 2"),  # cut off by the token limit: runs to the end
])
def test_extract_code(response, code):
    assert extract_code(response) == code


def test_parse_tests_layouts_and_errors():
    assert parse_tests("assert f(1) == 1\n\nassert f(2) == 2\n") == ["assert f(1) == 1", "assert f(2) == 2"]
    assert parse_tests(["assert f(1) == 1", "x = f(2)\nassert x == 2"]) == ["assert f(1) == 1", "x = f(2)\nassert x == 2"]
    for bad in ("", "\n \n", [], None, 3, [1, 2]):
        with pytest.raises(ValueError, match="--data.answer-key"):
            parse_tests(bad)


# ---------------------------------------------------------------- scores

TESTS = "assert f(1) == 2\nassert f(5) == 10\nassert f(-3) == -6"


@pytest.mark.parametrize("response, score", [
    ("```python\ndef f(x):\n    return 2 * x\n```", 1.0),
    ("def f(x):\n    return x + 1\n", 1 / 3),   # right for f(1) only
    ("def f(x):\n    return x\n", 0.0),
    ("def f(x) return 2 * x", 0.0),            # a syntax error
    ("The answer is 2x.", 0.0),                # no code at all
    ("import math\nfrom collections import Counter\ndef f(x):\n    return int(math.copysign(2 * abs(x), x))\n", 1.0),
])
def test_code_score(response, score):
    out = code_score(response, TESTS)
    assert out["score"] == pytest.approx(score)
    assert out["all_passed"] == float(score == 1.0) and out["timed_out"] == 0.0


def test_a_test_that_raises_fails_alone_and_the_working_directory_is_writable():
    source = ("def f(x):\n    return 10 // x\n"
              "with open('scratch.txt', 'w') as out:\n    out.write('kept')\n")
    result = run_tests(source, ["assert f(2) == 5", "f(0)", "assert open('scratch.txt').read() == 'kept'"])
    assert result.passed == [True, False, True] and result.error is None


# ---------------------------------------------------------------- tests split into probes, checked here

@pytest.mark.parametrize("test, probes", [
    ("assert f(2) == 4", ["f(2)"]),
    ("assert abs(f(1.5) - 3.0) < 1e-9", ["f(1.5)"]),
    ("assert set(f([1, 2])) == {1, 2}", ["f([1, 2])"]),
    ("assert math.isclose(area(2), 12.56, rel_tol=0.01)", ["area(2)"]),
    ("assert f(2) + f(3) == 10, 'sum'", ["f(2)", "f(3)"]),
    ("assert all(v > 0 for v in f(3))", ["f(3)"]),
    ("assert Pair(1, 2).x == 1 and f(3)[0] == 'a'", ["Pair(1, 2).x", "f(3)"]),
    ("assert f(3).startswith('ab') and f(4).count(2) == 1", ["f(3)", "f(4)"]),
    ("x = f(2)\nassert x == 4", ["f(2)"]),
    ("f(0)", ["f(0)"]),
    ("assert True", []),
])
def test_a_test_is_split_into_probes_that_hold_no_expected_value(test, probes):
    assert [probe.source for probe in plan(test).probes] == probes


@pytest.mark.parametrize("test", [
    "for i in range(3):\n    assert f(i) == 2 * i", "def g():\n    return f(1)",
    "assert [f(i) for i in range(3)] == [0, 2, 4]", "x = 2\nassert f(x) == 4", "assert (y := f(2)) == 4",
    "import os\nassert f(1) == 2", "assert sorted(f(3), key=lambda t: f(t)) == [1]",
])
def test_a_test_that_cannot_be_split_is_untrusted(test):
    with pytest.raises(Untrusted):
        plan(test)


def test_untrusted_tests_fail_unrun_and_are_counted():
    tests = ["assert f(1) == 2", "for i in range(3):\n    assert f(i) == 2 * i"]
    assert code_score(HONEST, tests) == {"score": 0.5, "all_passed": 0.0, "timed_out": 0.0, "untrusted_tests": 0.5}


VALUES = """
import collections, enum
Point = collections.namedtuple("Point", "x y")
Colour = enum.IntEnum("Colour", "RED")

def f(kind):
    return {"tuple": (1, "a", None), "float": 0.1 + 0.2, "complex": complex(-2, 2.4492935982947064e-16),
            "set": {1, 2}, "frozenset": frozenset({3}), "dict": {"a": [1, 2], (1, 2): {3}}, "bytes": b"\\x00\\xff",
            "str": "caf\\u00e9 \\U0001f600 \\udc80", "generator": (i * i for i in range(3)), "range": range(3),
            "keys": {"b": 1, "a": 2}.keys(), "namedtuple": Point(1, 2), "ordered": collections.OrderedDict(b=1, a=2),
            "enum": Colour.RED, "big": 2 ** 1000, "true": True, "none": None, "negative zero": -0.0,
            "nested": [[[]]], "nan": float("nan"), "function": len, "cycle": (lambda l: l.append(l) or l)([])}[kind]
"""
HONEST_VALUE_TESTS = [
    "assert f('tuple') == (1, 'a', None)", "assert f('float') == 0.30000000000000004 and math.isclose(f('float'), 0.3)",
    "assert f('complex') == (-2+2.4492935982947064e-16j)", "assert f('set') == {2, 1}",
    "assert f('frozenset') == frozenset([3])", "assert f('dict') == {(1, 2): {3}, 'a': [1, 2]}",
    "assert f('bytes') == bytes([0, 255])", "assert f('str') == 'caf\\u00e9 \\U0001f600 \\udc80'",
    "assert list(f('generator')) == [0, 1, 4]", "assert f('generator') != [0, 1, 4]", "assert f('range') == range(3)",
    "assert sorted(f('keys')) == ['a', 'b']", "assert f('namedtuple') == (1, 2)",
    "assert list(f('ordered').items()) == [('b', 1), ('a', 2)]", "assert f('enum') == 1 and type(f('enum')) == int",
    "assert f('big') == 2 ** 1000", "assert f('true') is True", "assert f('none') is None",
    "assert str(f('negative zero')) == '-0.0'", "assert f('nested') == [[[]]]", "assert f('nan') != f('nan')",
    "assert f'{f(\"big\") % 7}:{len(f(\"tuple\"))}' == '2:3'",
]


def test_an_honest_solutions_values_come_back_as_themselves():
    result = run_tests(VALUES, HONEST_VALUE_TESTS)
    assert result.passed == [True] * len(HONEST_VALUE_TESTS), [t for t, ok in zip(HONEST_VALUE_TESTS, result.passed) if not ok]


def test_what_is_not_plain_data_fails_its_test():
    result = run_tests(VALUES, ["assert f('function') is not None", "assert f('cycle') is not None", "f('cycle')"])
    assert result.passed == [False, False, True]  # a statement of its own passes unless it raises


@pytest.mark.parametrize("value", [None, True, 0, -(2 ** 70), 0.1, float("inf"), -0.0, 1 + 2j, "é\U0001f600",
                                   b"\x00", [1, [2]], (1,), {1, 2}, frozenset({"a"}), {"k": (1, 2), 3: None}, range(1, 9, 2)])
def test_the_encoding_round_trips_plain_values(value):
    decoded = decode(json.dumps(encode(value)))
    assert decoded == value and type(decoded) is type(value)


@pytest.mark.parametrize("text", ['["set", [["list", []]]]', '["int", "12"]', '["str"]', '["bool", 1]', '["nope"]',
                                  "[" * 5000 + "]" * 5000, '["int", "0x' + "f" * 300000 + '"]', "not json"])
def test_the_decoder_takes_only_well_formed_plain_values(text):
    with pytest.raises(ValueError):
        decode(text)


@pytest.mark.parametrize("test, value", [("assert 2 ** f(1) > 0", 10 ** 12), ("assert 'x' * f(1) == ''", 10 ** 12),
                                         ("assert len(list(range(f(1)))) > 0", 10 ** 12),
                                         ("assert sum(1 for i in range(f(1)) for j in range(1000)) > 0", 1000),
                                         ("assert f(1).__class__ is int", 1), ("assert math.__dict__", 0)])
def test_the_checker_bounds_what_a_value_costs_it(test, value):
    start = time.monotonic()
    assert not check(plan(test), [value])
    assert time.monotonic() - start < 5


MERSENNE_61 = 2 ** 61 - 1  # CPython hashes an int modulo it: its multiples all hash to 0


def test_a_decoded_range_costs_its_length():
    # Three ints stand for any length: counted as its items, a range cannot grow the checker's
    # set(f(x)) to gigabytes (issue 44 #3).
    assert decode(json.dumps(encode(range(3, 1000, 7)))) == range(3, 1000, 7)
    for stop in (10 ** 18, 2 ** 64, 1 << 20):
        with pytest.raises(ValueError, match="too big"):
            decode(json.dumps(["range", "0x0", hex(stop), "0x1"]))
    assert isinstance(read_report('value 0 ["range", "0x0", "0xde0b6b3a7640000", "0x1"]', 1).values[0], ProbeFailed)


def colliding_ints(n: int) -> list[int]:
    return [k * MERSENNE_61 for k in range(1, n + 1)]


@pytest.mark.parametrize("text", [
    json.dumps(["set", [["int", hex(v)] for v in colliding_ints(16000)]]),
    json.dumps(["frozenset", [["tuple", [["int", hex(v)]]] for v in colliding_ints(16000)]]),
    json.dumps(["dict", [[["int", hex(v)], ["none"]] for v in colliding_ints(16000)]]),
], ids=["set", "frozenset of tuples", "dict"])
def test_decoding_values_of_one_hash_is_refused_in_linear_time(text):
    # A set of distinct values that share a hash takes quadratic time to build: 16k of them 2.5 s
    # of the reward worker's CPU, a whole report past the pool's timeout (issue 44 #3).
    start = time.process_time()
    with pytest.raises(ValueError, match="one hash"):
        decode(text)
    assert time.process_time() - start < 0.5


@pytest.mark.parametrize("test, value", [
    ("assert set(f(1)) == {1}", colliding_ints(16000)),
    ("assert frozenset(map(tuple, f(1))) == frozenset()", [[v] for v in colliding_ints(16000)]),
    ("assert {*f(1)} == {1}", colliding_ints(16000)),
    ("assert {v for v in f(1)} == {1}", colliding_ints(16000)),
    ("assert dict.fromkeys(f(1)) == {}", colliding_ints(16000)),
    ("assert dict(zip(f(1), f(1))) == {}", colliding_ints(16000)),
    ("assert {1}.union(f(1)) == {1}", colliding_ints(16000)),
])
def test_the_checker_refuses_values_of_one_hash_in_linear_time(test, value):
    start = time.process_time()
    assert not check(plan(test), [value] * len(plan(test).probes))
    assert time.process_time() - start < 0.5


def test_the_checkers_memory_is_bounded_where_it_runs_alone(tmp_path):
    # A width the solution chose (zfill, ljust, a format spec) can ask for any size of string:
    # in a reward worker, alone in its process, the check runs under an address-space limit.
    out = subprocess.run([sys.executable, "-c", textwrap.dedent("""
        from hflow.sandbox import checker
        from hflow.sandbox.probes import plan
        checker.MAX_CHECK_MEMORY = 256 << 20
        print(checker.check(plan("assert f(1).zfill(f(2))"), ["1", 1 << 30]))
        print(checker.check(plan("assert f(1).zfill(f(2))"), ["1", 5]))""")],
        capture_output=True, text=True, timeout=60)
    assert out.stdout.split() == ["False", "True"], out.stderr


@pytest.mark.parametrize("line", ["done \u00b2", "done \u0663", "value \u00b2 [\"none\"]", "done " + "9" * 5000,
                                  "value " + "9" * 5000 + " [\"none\"]", "raised \u00b2 E"],
                         ids=["superscript", "arabic-indic", "value superscript", "long", "value long", "raised"])
def test_the_report_reader_takes_only_ascii_indices(line):
    # str.isdigit accepts "\u00b2", int() does not: the reader raised (issue 44 #9)
    report = read_report(f"ran\n{line}\ndone 0\n", 1)
    assert report.ran and report.done == {0} and isinstance(report.values[0], ProbeFailed)


def test_a_probe_that_failed_fails_only_a_test_that_uses_its_value():
    test = plan("assert f(1) == 1 or g(1)")
    assert check(test, [1, ProbeFailed("NameError")]) and not check(test, [2, ProbeFailed("NameError")])


MBPP_LIKE = [  # test_list rows in MBPP's style, with right solutions
    ("def similar_elements(a, b):\n    return tuple(set(a) & set(b))\n",
     ["assert set(similar_elements((3, 4, 5, 6),(5, 7, 4, 10))) == set((4, 5))",
      "assert set(similar_elements((1, 2, 3, 4),(5, 4, 3, 7))) == set((3, 4))"]),
    ("import heapq\ndef heap_queue_largest(nums, n):\n    return heapq.nlargest(n, nums)\n",
     ["assert heap_queue_largest( [25, 35, 22, 85, 14, 65, 75, 22, 58],3)==[85, 75, 65]"]),
    ("import math\ndef area_circle(r):\n    return math.pi * r * r\n",
     ["assert math.isclose(area_circle(10), 314.15, rel_tol=0.001)", "assert abs(area_circle(1) - 3.1416) < 1e-4"]),
    ("def is_not_prime(n):\n    return any(n % d == 0 for d in range(2, int(n ** 0.5) + 1))\n",
     ["assert is_not_prime(2) == False", "assert is_not_prime(10) == True", "assert not is_not_prime(37)"]),
    ("def count_chars(s):\n    return {c: s.count(c) for c in s}\n",
     ["assert count_chars('aab') == {'a': 2, 'b': 1}", "assert sorted(count_chars('ba').items()) == [('a', 1), ('b', 1)]"]),
]


@pytest.mark.parametrize("solution, tests", MBPP_LIKE)
def test_mbpp_style_tests_score_right_solutions_one(solution, tests):
    assert code_score(solution, tests) == {"score": 1.0, "all_passed": 1.0, "timed_out": 0.0, "untrusted_tests": 0.0}


# ---------------------------------------------------------------- the reward pool

def test_score_batch_in_the_pool_mixes_right_wrong_and_hostile_programs():
    right = "```python\ndef f(x):\n    return 2 * x\n```"
    responses = [right, "def f(x):\n    return x + 1\n", "while True:\n    pass\n",
                 "import os\nos.abort()\n", "def f(x):\n    return 0\n", right]
    result = score_batch(get_reward_fn("code"), responses, [TESTS] * len(responses), num_workers=4)
    assert result.scores == pytest.approx([1.0, 1 / 3, 0.0, 0.0, 0.0, 1.0])
    assert result.failures == [None] * len(responses)  # the sandbox's limits come before the pool's timeout
    assert result.metrics["reward/all_passed"] == pytest.approx(2 / 6)
    assert result.metrics["reward/timed_out"] == pytest.approx(1 / 6)
    assert not sandbox_processes()


# ---------------------------------------------------------------- the built-in code task

def test_code_task_reference_solutions_pass_their_asserts_and_wrong_ones_fail():
    from hflow.data import TASKS, task_splits
    rows = TASKS["code"].problems()
    assert len({r["prompt"] for r in rows}) == len(rows) > 1000
    # A byte-level BPE makes at most one token per byte: the embedded default (256 positions)
    # has room for a 150-token answer after any of these prompts.
    assert max(len(r["prompt"].encode()) for r in rows) <= 100
    for row in rows:  # our own code, run here: the asserts come from an oracle written apart
        namespace = {}
        exec(row["extra"]["solution"], namespace)
        for test in parse_tests(row["answer"]):
            exec(test, namespace)
    train, held_out = task_splits("code", seed=0)  # the default --data.task-eval-size fits
    assert len(held_out) == 500 and not {r["prompt"] for r in train} & {r["prompt"] for r in held_out}
    sample = held_out[:4]
    responses = [r["extra"]["solution"] for r in sample] + ["def f(x):\n    return None\n"]
    result = score_batch(code_score, responses, [r["answer"] for r in sample + sample[:1]], num_workers=2)
    assert result.scores == [1.0, 1.0, 1.0, 1.0, 0.0]
