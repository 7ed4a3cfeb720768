"""The bounds every trajectory lives within, checked once when they are made."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from hflow.validation import ConfigError


@dataclass(frozen=True)
class AgentLimits:
    max_turns: int = 8
    """Model turns; a trajectory still going after this many ends as max_turns."""
    max_response_tokens: int = 1024
    """Model and observation tokens after the prompt together: the response width of the batch
    layout. A turn is given what is left; an observation that would leave no room ends the
    trajectory as max_tokens."""
    max_turn_tokens: Optional[int] = None
    """A cap on one model turn (None: only the response budget)."""
    max_observation_tokens: int = 512
    """The most tokens of one observation message's content; longer content is cut and marked.
    The chat template's wrapping around it is not counted."""
    tool_timeout_s: float = 10.0
    """One tool call, from when a worker starts running it (its wait for a free worker, and a fresh
    worker's start and import of the tool, are not counted); a call still running after this is
    killed and ends its trajectory as tool_timeout. A final answer's score function in a worker
    has as long (past it the answer scores 0, counted in reward_errors)."""
    step_timeout_s: float = 60.0
    """One environment step, its tool calls' running included, their waits for a worker not
    (agents.step_clock); past it the trajectory ends as env_timeout."""

    def __post_init__(self):
        problems = []

        def require(ok: bool, message: str):
            if not ok:
                problems.append(message)

        for name in ("max_turns", "max_response_tokens", "max_observation_tokens"):
            value = getattr(self, name)
            require(isinstance(value, int) and value >= 1, f"{name} must be an integer >= 1, got {value!r}")
        if self.max_turn_tokens is not None:
            require(isinstance(self.max_turn_tokens, int) and self.max_turn_tokens >= 1,
                    f"max_turn_tokens must be None or an integer >= 1, got {self.max_turn_tokens!r}")
        for name in ("tool_timeout_s", "step_timeout_s"):
            value = getattr(self, name)
            require(isinstance(value, (int, float)) and math.isfinite(value) and value > 0,
                    f"{name} must be a finite number of seconds > 0, got {value!r}")
        if not problems:
            require(self.step_timeout_s > self.tool_timeout_s,
                    f"step_timeout_s ({self.step_timeout_s:g}) must exceed tool_timeout_s ({self.tool_timeout_s:g}): "
                    "a step waits for its tool calls")
        if problems:
            raise ConfigError("agent limits: " + "; ".join(problems))

    def turn_budget(self, response_tokens_so_far: int) -> int:
        """How many tokens the next model turn may sample."""
        left = self.max_response_tokens - response_tokens_so_far
        return left if self.max_turn_tokens is None else min(left, self.max_turn_tokens)
