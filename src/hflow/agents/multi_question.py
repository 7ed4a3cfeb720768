"""Several problems in a row, one a turn, each turn rewarded on its own: a task for per-turn credit.

    env = MultiQuestion(questions=3, reward_fn="arithmetic")
    env.reset({"prompt": "27+82=", "answer": "109"})   # -> "27+82="
    env.step("109")     # -> StepResult("45-12=", 1.0)     the next problem, this answer's reward
    env.step("30")      # -> StepResult("63+18=", 0.0)
    env.step("81")      # -> StepResult(None, 1.0, done=True)

The first problem is the row's own; the others are drawn like it (the same operation, operands
of the same number of digits, a difference never negative) from a generator seeded by the row's
prompt, so that every trajectory of a prompt is asked the same problems in the same order (a
prompt's trajectories at turn t answer the same question: per-turn credit's step-wise groups).
Each answer is scored by `reward_fn` (an hflow score function: arithmetic, the completion starts
with the answer) and the trajectory's reward is their sum. The observations are the bare problems,
as the embedded default was taught them (`--data.task arithmetic`): `recipes/agent.py
--agent.env multi_question --data.task arithmetic`.
"""
from __future__ import annotations

import hashlib
import random
import re
from typing import Callable, Union

from hflow.agents.environment import StepResult
from hflow.agents.tool_environment import ToolEnvironment

PROBLEM = re.compile(r"^\s*(\d+)\s*([-+*])\s*(\d+)\s*=\s*$")


def follow_ups(prompt: str, count: int) -> list[tuple[str, str]]:
    """`count` problems like `prompt` ("a op b="): (prompt, answer) pairs, the same for the same
    prompt on every machine."""
    match = PROBLEM.match(prompt)
    if match is None:
        raise ValueError(f"multi_question asks problems like '27+82=' (two numbers and +, - or *); the row's "
                         f"prompt is {prompt[:60]!r} (use --data.task arithmetic or multiply)")
    a, op, b = match.groups()
    rng = random.Random(int.from_bytes(hashlib.sha256(f"hflow-multi-question-{prompt.strip()}".encode()).digest()[:8],
                                       "little"))
    out = []
    for _ in range(count):
        x, y = (rng.randrange(10 ** (len(d) - 1), 10 ** len(d)) for d in (a, b))
        if op == "-" and y > x:
            x, y = y, x
        out.append((f"{x}{op}{y}=", str(x + y if op == "+" else x - y if op == "-" else x * y)))
    return out


class MultiQuestion(ToolEnvironment):
    """`questions` problems, one per turn (the module docstring); no tools."""

    def __init__(self, questions: int = 3, reward_fn: Union[str, Callable, None] = "arithmetic", **kwargs):
        if questions < 1:
            raise ValueError(f"questions must be >= 1, got {questions}")
        super().__init__((), format="tags", reward_fn=reward_fn, **kwargs)
        self.questions, self.answers, self.next_problems = questions, [], []

    def reset(self, row: dict):
        prompt = super().reset(row)
        if not isinstance(prompt, str):
            raise ValueError("multi_question takes a text prompt ('27+82='), not chat messages")
        more = follow_ups(prompt, self.questions - 1)
        self.answers = [self.ground_truth] + [answer for _, answer in more]
        self.next_problems = [problem for problem, _ in more]
        return prompt

    def step(self, text: str) -> StepResult:
        self.ground_truth = self.answers.pop(0)   # what score() checks this turn's answer against
        reward, failed = self.score(text)
        info = {"reward_errors": failed} if failed else {}
        if not self.next_problems:
            return StepResult(None, reward, done=True, info=info)
        return StepResult(self.next_problems.pop(0), reward, info=info)
