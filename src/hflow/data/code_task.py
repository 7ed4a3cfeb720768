"""The built-in code task (``--data.task code``, scored by ``--reward.fn code``): write a small
Python function that passes three asserts.

    "Write a Python function f(x) that returns x plus 7."
    answer: "assert f(3) == 10\\nassert f(-41) == -34\\nassert f(120) == 127"

Eight kinds of function, each with a constant k, give 1,419 distinct problems; a row's ``extra``
holds a reference solution (``solution``), which passes its asserts. The task exists so that the
code reward can run end to end on the embedded default (give it room to answer:
``--rollout.max-tokens 48`` or more); the tiny default model is not expected to learn it.
"""
import random
from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class _Kind:
    name: str
    argument: str                          # the parameter's name in the prompt
    says: str                              # what f returns, with {k}
    body: str                              # the reference solution's return expression, with {k}
    expected: Callable[[object, int], object]   # an independent oracle of the asserts
    draw: Callable[[random.Random], object]     # one test input
    ks: range


def _number(rng: random.Random) -> int:
    return rng.randint(-50, 150)


def _numbers(rng: random.Random) -> list[int]:
    return [rng.randint(-20, 120) for _ in range(rng.randint(0, 5))]


_KINDS = (
    _Kind("add", "x", "x plus {k}", "x + {k}", lambda x, k: x + k, _number, range(1, 200)),
    _Kind("sub", "x", "x minus {k}", "x - {k}", lambda x, k: x - k, _number, range(1, 200)),
    _Kind("mul", "x", "x times {k}", "x * {k}", lambda x, k: x * k, _number, range(2, 200)),
    _Kind("mod", "x", "the remainder of x divided by {k}", "x % {k}", lambda x, k: x % k, _number, range(2, 200)),
    _Kind("max", "x", "the larger of x and {k}", "max(x, {k})", lambda x, k: x if x > k else k, _number, range(1, 200)),
    _Kind("count", "xs", "how many numbers in the list xs are greater than {k}",
          "sum(1 for v in xs if v > {k})", lambda xs, k: len([v for v in xs if v > k]), _numbers, range(1, 200)),
    _Kind("shift", "xs", "the list xs with {k} added to each number", "[v + {k} for v in xs]",
          lambda xs, k: [v + k for v in xs], _numbers, range(1, 200)),
    _Kind("repeat", "s", "the string s repeated {k} times", "s * {k}", lambda s, k: s * k,
          lambda rng: "".join(rng.choice("abcxyz") for _ in range(rng.randint(1, 4))), range(2, 30)),
)


@dataclass(frozen=True)
class CodeTask:
    """``"Write a Python function f(x) that returns x plus 7."`` -> three assert lines, run by
    the ``code`` reward against the response's code (see hflow.rewards.code)."""
    tests_per_problem: int = 3
    reward_fn: str = "code"

    def problems(self) -> list[dict]:
        rows = []
        for kind in _KINDS:
            for k in kind.ks:
                rng = random.Random(f"{kind.name}:{k}")  # a string seed: the same tests on every machine
                inputs = [kind.draw(rng) for _ in range(self.tests_per_problem)]
                tests = [f"assert f({x!r}) == {kind.expected(x, k)!r}" for x in inputs]
                rows.append({
                    "prompt": f"Write a Python function f({kind.argument}) that returns {kind.says.format(k=k)}.\n",
                    "answer": "\n".join(tests),
                    "extra": {"solution": f"def f({kind.argument}):\n    return {kind.body.format(k=k)}\n"},
                })
        return rows
