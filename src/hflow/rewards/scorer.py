"""RewardConfig (--reward.* flags) and Scorer: the rule a run scores its responses by."""
import threading
import time
from dataclasses import dataclass
from typing import Literal, Optional, Sequence

from hflow.rewards.code import code_score
from hflow.rewards.pool import RewardPool, ScoredBatch, score_batch
from hflow.rewards.registry import get_reward_fn
from hflow.sandbox import sandbox_isolation

DEFAULT_RULE = "arithmetic"   # the built-in task's checker: what an empty --reward.fn means


@dataclass
class RewardConfig:
    """How a rollout is scored: a rule (--reward.fn), a reward model in the loop (--reward.model),
    a generative judge (--reward.judge), or several: score = rule + w * rm + wj * judge, each
    part present only when given. Held-out evaluation always uses the rule."""

    fn: str = ""
    """Rule score function: arithmetic, gsm8k, gsm8k_flexible, math, countdown, code, reasoning_gym, or 'package.module:function'; empty: the built-in --data.task's own checker (arithmetic, code, or reasoning_gym for an rg: task; arithmetic with --data.train-files), and with --reward.model no rule in the training score (evaluation still uses it)."""
    model: str = ""
    """Reward model in the loop: a Hugging Face sequence-classifier directory sharing the policy's tokenizer (e.g. from recipes/reward_model.py), or 'default': the embedded default's, trained on arithmetic pairs once and cached; empty: none."""
    model_weight: float = 1.0
    """w: the training score is w * rm, or rule + w * rm when --reward.fn is given too."""
    judge: str = ""
    """Generative judge in the loop (hflow.workers.judge): a causal LM (a Hugging Face directory, a .gguf file, a Hub id or a fetched name) prompted with --reward.judge-template on each (prompt, response, reference) and its greedy verdict parsed by --reward.judge-parse to a score in [0, 1]; a role of its own ("judge"), placed like a reward model, asleep while the actor trains; its own tokenizer. Empty: none."""
    judge_template: str = ""
    """File of the judge's prompt, with the fields {prompt} {response} {reference} (the row's ground truth; a literal brace: {{ }}); empty: the built-in one (docs/recipes.md), which asks for what --reward.judge-parse reads."""
    judge_parse: Literal["score", "yes_no"] = "score"
    """How a verdict becomes a score: score = the LAST 'Score: N' or '<score>N</score>' (case-insensitive), N in --reward.judge-score-range [lo, hi], scaled to (N - lo) / (hi - lo); yes_no = the LAST standalone word yes (1) or no (0). Anything else is unparsable: it scores 0 and is counted in reward/judge_unparsable."""
    judge_score_range: tuple[float, float] = (0.0, 10.0)
    """[lo, hi] of N in 'Score: N'; a number outside it is unparsable."""
    judge_max_tokens: int = 64
    """New tokens of one verdict (greedy: the judge samples at temperature 0)."""
    judge_weight: float = 1.0
    """wj: the judge's part of the training score (alone: wj * judge)."""
    judge_free_weights: bool = False
    """Between judgings free the judge's weights too, not only its KV cache (read from disk again at each step): memory for the actor's update at the cost of a read."""
    model_max_tokens_per_micro_batch: int = 8192
    """Token budget of one reward-model forward on one rank."""
    num_workers: int = 0
    """Worker processes that score responses (user functions and the math scorer run there); 0: one per CPU core, at most 4. They start, and load the function, before the first step."""
    timeout: float = 10.0
    """Seconds one response may take to score; a slower one scores 0 and its worker is replaced."""
    inline: Optional[bool] = None
    """Score in the controller process: None = only the fast built-ins; True = always (no timeout; for debugging)."""
    max_failed_batches: int = 3
    """Stop the run once this many batches in a row had every response's scoring fail (raised, timed out, crashed or returned no real number): a reward that never works teaches nothing (0: never stop; ReMax scores two batches a step)."""


class Scorer:
    """``RewardConfig``'s rule made callable: ``Scorer(cfg.reward)(responses, ground_truths, extras)``
    (a reward model in the loop is hflow.recipe_kit.scoring.Rewards' part)."""

    def __init__(self, cfg: RewardConfig):
        self.cfg = cfg
        self.fn = get_reward_fn(cfg.fn or DEFAULT_RULE)
        if self.fn is code_score:   # the run says once which isolation its sandbox has
            print(f"hflow: code sandbox: {sandbox_isolation()}", flush=True)
        self._pool: Optional[RewardPool] = None

    @property
    def inline(self) -> bool:
        return self.cfg.inline if self.cfg.inline is not None else getattr(self.fn, "inline_safe", False)

    def start(self) -> None:
        """Start the worker processes (unless the rule scores inline) in the background, each
        loading the function, and say so: while the models build, not in the first step's time."""
        if self.inline or self._pool is not None:
            return
        self._pool = RewardPool(self.cfg.num_workers)
        name = self.cfg.fn or DEFAULT_RULE
        print(f"hflow: starting {self._pool.num_workers} reward worker processes for {name} "
              f"(--reward.num-workers)", flush=True)

        def load(pool=self._pool, began=time.monotonic()):
            loaded = pool.start(self.fn)
            print(f"hflow: {loaded} of {pool.num_workers} reward workers ready in "
                  f"{time.monotonic() - began:.0f} s", flush=True)
        threading.Thread(target=load, daemon=True, name="hflow-reward-start").start()

    def __call__(self, responses: Sequence[str], ground_truths: Sequence,
                 extras: Optional[Sequence[dict]] = None) -> ScoredBatch:
        inline = self.inline
        if not inline and self._pool is None:
            self._pool = RewardPool(self.cfg.num_workers)
        return score_batch(self.fn, responses, ground_truths, extras, timeout=self.cfg.timeout,
                           inline=inline, pool=self._pool)

    def close(self):
        if self._pool is not None:
            self._pool.close()
