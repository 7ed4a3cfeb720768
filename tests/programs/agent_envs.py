"""Environments that tests/test_agent_recipe.py names by path (`--agent.env .../agent_envs.py:Class`)."""
from hflow.agents import Environment, StepResult


class ThreeTurns(Environment):
    """Answers the first two turns with an observation whatever they say, then ends. The reward
    is the parity of the model's characters over the three turns: random-looking, so that a
    prompt's trajectories differ and the advantages are not all 0."""
    turns = 3

    def reset(self, row):
        self.left, self.chars = self.turns, 0
        return row["prompt"]

    def step(self, text):
        self.left -= 1
        self.chars += len(text)
        if self.left == 0:
            return StepResult(None, reward=float(self.chars % 2), done=True)
        return StepResult(f" noted {self.left}", info={"tool_calls": 1})
