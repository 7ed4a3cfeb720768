"""Two environments to copy: `--agent.env examples/agent_envs.py:Guess` or `...:UnitsQuiz`.

Guess is an environment from scratch: reset(row) gives the first observation, step(text) answers
each model turn. UnitsQuiz is the same task shape with a tool: a typed, documented function
(its JSON schema goes to the chat template's tools=), and ToolEnvironment runs the calls until
the model answers; its final answer is scored by a reward rule.
"""
import re

from hflow.agents import Environment, StepResult, ToolEnvironment, ToolInputError, tool


class Guess(Environment):
    """Guess the row's number in at most 6 turns, told higher or lower; reward 1 if found."""

    def reset(self, row):
        self.secret, self.turns = int(row["answer"]), 0
        return "I am thinking of a number from 1 to 100. Reply with one number.\n"

    def step(self, text):
        self.turns += 1
        found = re.search(r"-?\d+", text)
        guess = int(found.group()) if found else None
        if guess == self.secret:
            return StepResult(None, reward=1.0, done=True)
        hint = "higher" if guess is None or guess < self.secret else "lower"
        return StepResult(f"{hint}\n", done=self.turns >= 6, info={"wrong_guesses": 1})


@tool(tag="convert")
def to_metres(value: float, unit: str) -> str:
    """Convert a length to metres.

    Args:
        value: The length in `unit`.
        unit: One of mm, cm, km, in, ft, mi.
    """
    factors = {"mm": 1e-3, "cm": 1e-2, "km": 1e3, "in": 0.0254, "ft": 0.3048, "mi": 1609.344}
    if unit.strip() not in factors:   # told to the model; any other exception ends the trajectory
        raise ToolInputError(f"unknown unit {unit!r}; use one of {', '.join(factors)}")
    return f"{value * factors[unit.strip()]:g}"


class UnitsQuiz(ToolEnvironment):
    """"How many metres is 3 ft?": the model may call to_metres (Qwen's <tool_call> JSON, or
    <convert>{"value": 3, "unit": "ft"}</convert> with format="tags"); its answer is scored by
    the last number in it against the row's answer (gsm8k_flexible)."""

    def __init__(self):
        super().__init__([to_metres], format="hermes", reward_fn="gsm8k_flexible")
