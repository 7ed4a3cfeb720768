"""Built-in generated tasks: prompt datasets that need no file, for the embedded default model.

A task enumerates every distinct problem it can pose, shuffles them with a seed and cuts the
held-out split off the front; the rest is the training split. The splits are therefore disjoint
(no prompt appears in both) and the same for the same seed on every machine.

``rg:<name>`` is any of reasoning-gym's datasets instead (hflow.data.reasoning_gym): drawn rather
than enumerated, deduplicated, and split the same way.
"""
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from hflow.data.code_task import CodeTask
from hflow.data.config import DataError, flag
from hflow.data.reasoning_gym import PREFIX as REASONING_GYM_PREFIX
from hflow.data.reasoning_gym import ReasoningGymTask


@dataclass(frozen=True)
class ArithmeticTask:
    """``"12+35="`` -> ``"47"``, ``"47-35="`` -> ``"12"``: two operands of ``digits`` digits;
    subtraction puts the larger operand first, so every answer is a non-negative integer.
    Scored by the ``arithmetic`` reward (the completion must start with the answer).
    With 2 digits: 8,100 sums + 4,095 differences = 12,195 distinct problems."""
    digits: int = 2
    reward_fn: str = "arithmetic"

    def problems(self) -> list[dict]:
        low, high = 10 ** (self.digits - 1), 10 ** self.digits
        rows = [{"prompt": f"{a}+{b}=", "answer": str(a + b)}
                for a in range(low, high) for b in range(low, high)]
        rows += [{"prompt": f"{a}-{b}=", "answer": str(a - b)}
                 for a in range(low, high) for b in range(low, a + 1)]
        return rows


@dataclass(frozen=True)
class MultiplyTask:
    """``"127*46="`` -> ``"5842"``: a ``digits[0]``-digit number times a ``digits[1]``-digit one,
    which the embedded default cannot work out in its head but can with a calculator call
    (recipes/agent.py's default task). 900 x 90 = 81,000 distinct problems with (3, 2) digits.
    Scored by the ``arithmetic`` reward on the final answer."""
    digits: tuple = (3, 2)
    reward_fn: str = "arithmetic"

    def problems(self) -> list[dict]:
        (a_low, a_high), (b_low, b_high) = ((10 ** (d - 1), 10 ** d) for d in self.digits)
        return [{"prompt": f"{a}*{b}=", "answer": str(a * b)} for a in range(a_low, a_high) for b in range(b_low, b_high)]


TASKS = {"arithmetic": ArithmeticTask(), "multiply": MultiplyTask(), "code": CodeTask()}


def get_task(name: str, args: Sequence[str] = ()):
    """The built-in task ``--data.task`` names (``args``: ``--data.task-args``, rg: tasks only)."""
    if name.startswith(REASONING_GYM_PREFIX):
        return ReasoningGymTask(name[len(REASONING_GYM_PREFIX):], tuple(args))
    if name not in TASKS:
        raise DataError(f"{flag('task')}: unknown task {name!r} (built in: {', '.join(sorted(TASKS))}; "
                        f"or {REASONING_GYM_PREFIX}NAME, a reasoning-gym dataset)")
    if args:
        raise DataError(f"{flag('task_args')} is for {REASONING_GYM_PREFIX} tasks; task {name!r} takes none")
    return TASKS[name]


def task_reward_fn(name: str) -> str:
    """The reward a built-in task is scored by: what an empty --reward.fn should mean when the
    prompts come from ``--data.task name``."""
    return get_task(name).reward_fn


def task_splits(name: str, seed: int = 0, eval_size: int = 500, size: int = 10_000,
                args: Sequence[str] = ()) -> tuple[list[dict], list[dict]]:
    """(train rows, held-out rows) of a built-in task; rows are ``{"prompt", "answer"}`` (and
    ``extra``). ``size`` and ``args`` apply to rg: tasks only (the others enumerate every problem)."""
    task = get_task(name, args)
    if isinstance(task, ReasoningGymTask):
        return task.splits(seed, size, eval_size)
    problems = task.problems()
    if not 0 < eval_size < len(problems):
        raise DataError(f"{flag('task_eval_size')} must be in 1..{len(problems) - 1} for task "
                        f"{name!r} ({len(problems)} problems), got {eval_size}")
    order = np.random.default_rng(seed).permutation(len(problems))
    return [problems[i] for i in order[eval_size:]], [problems[i] for i in order[:eval_size]]
