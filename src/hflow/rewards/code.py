"""Code reward (``--reward.fn code``): run a generated Python solution against tests, in the code
sandbox (``hflow.sandbox``, whose docstring describes the boundary and the trust model).

Layout. The ground truth (the ``--data.answer-key`` column) holds the tests: a list of Python
statements (MBPP's ``test_list``: ``--data.answer-key test_list``) or one string with one
statement per line (the built-in ``--data.task code``), typically ``assert f(2) == 4``. The
response is the solution: its last ```` ```python ```` block (or ```` ```py ````, or an unlabelled
fence; an unclosed one runs to the end), or the whole text when it has no fence.

Score: the fraction of the tests that pass, 0 when the solution itself raises, exits or hits a
limit before its tests (partial credit is the denser signal; ``all_passed`` is the strict rate).
The sandbox checks each test outside the solution's process, on the values of the parts that call
into the solution; a test it cannot split so is not run and fails, and the ``untrusted_tests``
metric is their fraction of the row's tests. Other metrics: ``all_passed``, ``timed_out`` (wall
or CPU limit).
"""
import re

from hflow.sandbox import run_tests

_FENCE = re.compile(r"```(?:python|py)?[ \t]*\n(.*?)(?:```|\Z)", re.DOTALL)


def extract_code(response: str) -> str:
    """The last fenced code block of ``response`` (python, py or unlabelled), else the whole text."""
    blocks = _FENCE.findall(response)
    return blocks[-1] if blocks else response


def parse_tests(ground_truth) -> list[str]:
    """The tests of a row: a list of statements, or a string with one statement per line."""
    if isinstance(ground_truth, str):
        tests = [line for line in ground_truth.splitlines() if line.strip()]
    elif isinstance(ground_truth, (list, tuple)) and all(isinstance(t, str) for t in ground_truth):
        tests = [t for t in ground_truth if t.strip()]
    else:
        raise ValueError(f"code reward: the ground truth must hold the tests, a list of statements or "
                         f"a string with one per line (--data.answer-key); got {type(ground_truth).__name__}")
    if not tests:
        raise ValueError("code reward: a row has no tests (its --data.answer-key value is empty)")
    return tests


def code_score(response: str, ground_truth, **extra) -> dict:
    """Fraction of the tests (``ground_truth``) that pass after the response's code ran."""
    tests = parse_tests(ground_truth)
    result = run_tests(extract_code(response), tests)
    passed = sum(result.passed)
    return {"score": passed / len(tests), "all_passed": float(passed == len(tests)),
            "timed_out": float(result.timed_out), "untrusted_tests": sum(result.untrusted) / len(tests)}
