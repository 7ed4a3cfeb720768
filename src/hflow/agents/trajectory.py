"""One multi-turn trajectory as the token stream the model saw: it only ever grows.

The prompt's ids come first; then segments alternate: the model's tokens exactly as sampled,
with their sampled log-probs, and the observation tokens an environment's reply became. Nothing
is ever decoded and re-tokenised, so the ids trained on are the ids the policy produced, and the
log-probs line up with them token for token.
"""
from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Iterable, Optional, Sequence

# How a trajectory ended. The failures score 0 whatever the environment's rewards were: a broken
# tool or environment is no evidence about the policy.
DONE = "done"                        # the environment said so
MAX_TURNS = "max_turns"
MAX_TOKENS = "max_tokens"            # the response budget: a turn cut short, or no room for the next observation
MAX_TURN_TOKENS = "max_turn_tokens"  # one turn hit its own cap before its end-of-turn token
NO_END_OF_TURN = "no_end_of_turn"    # the model stopped on another stop token while the environment wanted more
TOOL_ERROR = "tool_error"            # a tool raised, returned garbage or could not be loaded in a worker
TOOL_TIMEOUT = "tool_timeout"        # a tool call ran past limits.tool_timeout_s
TOOL_CRASH = "tool_crash"            # a tool's worker process died under it (a segfault, the OOM killer)
ENV_ERROR = "env_error"              # reset/step raised or returned garbage, or its observation did not render
ENV_TIMEOUT = "env_timeout"          # a step ran past limits.step_timeout_s of its own time
BAD_TOOL_CALL = "bad_tool_call"      # only when the environment ends trajectories on malformed calls

FAILURES = frozenset({TOOL_ERROR, TOOL_TIMEOUT, TOOL_CRASH, ENV_ERROR, ENV_TIMEOUT, BAD_TOOL_CALL})
# Not a way to end: the trajectory ended, but the score function failed on its final answer (scored 0).
REWARD_FN_FAILED = "reward_fn"


@dataclass
class Segment:
    token_ids: list[int]
    logprobs: Optional[list[float]]
    """The sampled tokens' log-probs; None for an observation, which the policy did not sample."""
    policy_versions: Optional[list[int]] = None
    """For a model turn, the policy version (the trainer's updates behind the weights) that sampled
    each of its tokens, when the generation loop records them (asynchronous RL; a partial rollout
    may change the weights within a turn); None otherwise."""

    @property
    def from_model(self) -> bool:
        return self.logprobs is not None


@dataclass
class Trajectory:
    prompt_ids: list[int]
    segments: list[Segment] = field(default_factory=list)
    turn_rewards: list[float] = field(default_factory=list)
    """The environment's reward for each model turn it answered."""
    model_texts: list[str] = field(default_factory=list)
    """Each model turn decoded as the environment read it (end-of-turn token dropped)."""
    counts: Counter = field(default_factory=Counter)
    """What the environments' steps counted (tool_calls, bad_tool_calls, ...) and truncated observations."""
    finish_reason: Optional[str] = None
    error: Optional[str] = None
    """For a failure, what went wrong (the exception, the tool's message)."""
    failed: bool = False
    """Ended by a failure (one of FAILURES, or an environment's own AgentFailure): reward 0."""

    # ---- growing it

    def add_model_turn(self, token_ids: Sequence[int], logprobs: Sequence[float], text: str) -> None:
        if len(token_ids) != len(logprobs):
            raise ValueError(f"a model turn of {len(token_ids)} tokens came with {len(logprobs)} log-probs")
        if not token_ids:
            raise ValueError("a model turn has no tokens")
        self.segments.append(Segment(list(token_ids), [float(x) for x in logprobs]))
        self.model_texts.append(text)

    def add_observation(self, token_ids: Sequence[int]) -> None:
        if token_ids:
            self.segments.append(Segment(list(token_ids), None))

    def finish(self, reason: str, error: Optional[str] = None, failed: Optional[bool] = None) -> None:
        if self.finish_reason is not None:
            raise RuntimeError(f"trajectory already ended ({self.finish_reason})")
        self.finish_reason, self.error = reason, error
        self.failed = reason in FAILURES if failed is None else failed

    # ---- reading it

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def num_turns(self) -> int:
        return sum(s.from_model for s in self.segments)

    @property
    def num_model_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.segments if s.from_model)

    @property
    def num_observation_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.segments if not s.from_model)

    def response_ids(self) -> list[int]:
        """Everything after the prompt: model and observation tokens, in order."""
        return [t for s in self.segments for t in s.token_ids]

    def token_ids(self) -> list[int]:
        """Prompt and response: the prompt of the next turn's request."""
        return self.prompt_ids + self.response_ids()

    def response_mask(self) -> list[int]:
        """1 on the model's tokens (they are trained on), 0 on observation tokens."""
        return [int(s.from_model) for s in self.segments for _ in s.token_ids]

    def rollout_logprobs(self) -> list[float]:
        """Aligned with response_ids(); 0.0 under observation tokens (masked out anyway)."""
        return [lp for s in self.segments for lp in (s.logprobs or [0.0] * len(s.token_ids))]

    def model_text(self) -> str:
        """The model's turns joined, observations left out (for logs and text metrics)."""
        return "".join(self.model_texts)

    @property
    def final_text(self) -> str:
        """The last model turn: the answer an outcome reward scores."""
        return self.model_texts[-1] if self.model_texts else ""

    def reward(self, discount: float = 1.0) -> float:
        """The turns' rewards summed, turn t weighted by discount**t; 0 for a failure."""
        if not 0.0 <= discount <= 1.0:
            raise ValueError(f"discount must be in [0, 1], got {discount}")
        if self.failed:
            return 0.0
        return math.fsum(r * discount ** t for t, r in enumerate(self.turn_rewards))


def failure_of(finish_reason: Optional[str], failed: bool, reward_errors: int) -> Optional[str]:
    """Why a trajectory's reward is 0 for want of a working environment: the failure that ended
    it, or REWARD_FN_FAILED; None when nothing failed (running out of turns or tokens is the
    policy's doing)."""
    if failed:
        return finish_reason
    return REWARD_FN_FAILED if reward_errors else None


def failure_counts(failures: Iterable[Optional[str]], prefix: str = "agent/") -> dict[str, int]:
    """failures/<reason>: how many trajectories failed each way (failure_of's), every known way
    included at 0, so that a run's charts have each line at every step."""
    counts = Counter(f for f in failures if f)
    reasons = sorted(FAILURES | {REWARD_FN_FAILED} | set(counts))
    return {f"{prefix}failures/{reason}": counts[reason] for reason in reasons}


def agent_metrics(trajectories: Sequence[Trajectory], prefix: str = "agent/") -> dict[str, float]:
    """Means of turns and token counts, the counted events per trajectory, the fraction of
    trajectories that ended each way (finish/<reason>) and how many failed each way
    (failures/<reason>)."""
    n = len(trajectories)
    if not n:
        return {}
    metrics = {
        f"{prefix}turns": sum(t.num_turns for t in trajectories) / n,
        f"{prefix}model_tokens": sum(t.num_model_tokens for t in trajectories) / n,
        f"{prefix}observation_tokens": sum(t.num_observation_tokens for t in trajectories) / n,
        f"{prefix}failed": sum(t.failed for t in trajectories) / n,
    }
    counts = Counter()
    for t in trajectories:
        counts.update(t.counts)
    metrics.update({f"{prefix}{key}": value / n for key, value in sorted(counts.items())})
    reasons = Counter(t.finish_reason or "unfinished" for t in trajectories)
    metrics.update({f"{prefix}finish/{reason}": k / n for reason, k in sorted(reasons.items())})
    metrics.update(failure_counts((failure_of(t.finish_reason, t.failed, t.counts.get("reward_errors", 0))
                                   for t in trajectories), prefix))
    return metrics
