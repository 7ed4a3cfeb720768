"""The training score of a rollout: a rule (--reward.fn), a reward model in the loop
(--reward.model), a generative judge (--reward.judge, hflow.recipe_kit.judging), or several.

    sets = [["actor", ...], reward_roles(cfg.reward)]                  # "reward": a role to place
    rewards = Rewards(cluster, cfg.reward, tokenizer, reward_model_dir, placement.get("reward"),
                      judge_ranks=placement.get("judge"))
    scores, metrics = rewards(batch)   # reward/mean; with a model also reward/rule_mean, reward/rm_mean, reward/rm_std;
                                       # with a judge reward/rule_mean, reward/judge_* (judging.py)
    scores, scored = score(batch, tokenizer, rewards.rule)             # the rule alone (held-out evaluation)
    # scores known already (an environment's) kept as the rule's are: samples, the stop, the warning
    rewards.record(batch, env_scores, failures, culprit="the environment", unit="trajectory", fix="fix --agent.env X")
"""
from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoTokenizer

from hflow.batch import Batch
from hflow.rewards import RewardConfig, ScoredBatch, Scorer
from hflow.recipe_kit.judging import JudgeReward
from hflow.recipe_kit.text_batches import prompt_texts, response_texts
from hflow.validation import UserError
from hflow.workers import RewardModel, RewardModelConfig


def reward_roles(reward: RewardConfig) -> list[str]:
    """The scorers that are models, each a role to place like any model: "reward" when a reward
    model is in the loop, "judge" when a generative judge is."""
    return ["reward"] * bool(reward.model) + ["judge"] * bool(reward.judge)


def score(batch: Batch, tokenizer, rule: Scorer) -> tuple[torch.Tensor, ScoredBatch]:
    """One rule score per sequence of a rollout Batch, and the scorer's full result (its
    metrics reward/*, and why each failed response failed)."""
    scored = rule(response_texts(batch, tokenizer), batch["ground_truth"], batch["extra"])
    return torch.tensor(scored.scores, dtype=torch.float32), scored


class ScoringFailed(UserError):
    """Every response's scoring failed, batch after batch: the reward function is broken."""


class Rewards:
    """The training score of a rollout: the rule (--reward.fn) alone; with a reward model
    (`model_dir`, spawned here on `ranks`) w * rm, or rule + w * rm when --reward.fn is given
    too; a generative judge (--reward.judge, spawned on `judge_ranks`) adds wj * judge. The
    rule is always computed: it is logged, and held-out evaluation uses it (`rewards.rule`)."""

    def __init__(self, cluster, cfg: RewardConfig, tokenizer, model_dir: str | None = None, ranks=None,
                 judge_ranks=None):
        self.cfg, self.tokenizer, self.rule = cfg, tokenizer, Scorer(cfg)
        self.rule.start()   # its worker processes load the function while the models build
        self.model = None
        self.equal_batches = 0   # batches so far whose responses all scored alike (the first few only)
        self.samples: list[dict] = []   # a few rows of the latest batch: prompt, response, score
        self.failed_batches = 0  # batches in a row in which every response's scoring failed
        if model_dir:
            rm_cfg = RewardModelConfig(model_path=str(model_dir), max_tokens_per_micro_batch=cfg.model_max_tokens_per_micro_batch)
            self.model = cluster.spawn(RewardModel, rm_cfg, ranks=ranks)
        self.judge = JudgeReward(cluster, cfg, judge_ranks) if cfg.judge else None

    def __call__(self, batch: Batch) -> tuple[torch.Tensor, dict]:
        """One training score per sequence of a rollout Batch, and the metrics (reward/*)."""
        # the reward model works on its ranks while the controller applies the rule
        # the reward model and the judge work on their ranks while the controller applies the rule
        pending = self.model.scores.future(batch.select("input_ids", "attention_mask", "response_mask")) \
            if self.model else None
        judging = self.judge.request(batch, self.tokenizer) if self.judge else None
        rule, scored = score(batch, self.tokenizer, self.rule)
        metrics = scored.metrics
        if pending is None and judging is None:   # the rule is the training score
            self.record(batch, rule, scored.failures)
            return rule, metrics
        if self.cfg.fn:   # the rule is part of the training score
            self.stop_if_scoring_keeps_failing(scored.failures)
        scores = rule if self.cfg.fn else torch.zeros(len(batch))
        metrics["reward/rule_mean"] = metrics.pop("reward/mean")
        if pending is not None:
            rm = pending.result()["rm_scores"]
            scores = scores + self.cfg.model_weight * rm
            metrics |= {"reward/rm_mean": rm.mean().item(), "reward/rm_std": rm.std().item() if len(rm) > 1 else 0.0}
        if judging is not None:
            judged, failures, judge_metrics = self.judge.result(judging)
            scores = scores + self.cfg.judge_weight * judged
            metrics |= judge_metrics
            if not self.cfg.fn and pending is None:   # the judge alone: one that never parses teaches nothing
                self.stop_if_scoring_keeps_failing(failures, "the judge", "verdict", "make the verdicts parse "
                                                   "(--reward.judge-template, --reward.judge-parse), or use a "
                                                   "stronger --reward.judge")
        self.samples = self.sampled(batch, scores)
        self.warn_if_no_signal(scores)
        return scores, metrics | {"reward/mean": scores.mean().item()}

    def record(self, batch: Batch, scores: torch.Tensor, failures: list[str | None],
               culprit: str = "the reward function", unit: str = "response", fix: str | None = None) -> None:
        """Keep a batch's training scores as the rule's are kept, whoever computed them (the rule,
        an environment): a few rows as the samples, `failures` (per row None, or why its score
        is 0) toward the stop, the no-signal warning. `culprit`, `unit` and `fix` word the stop's
        message (`fix` None: fix --reward.fn)."""
        self.samples = self.sampled(batch, scores)
        self.stop_if_scoring_keeps_failing(failures, culprit, unit, fix)
        if not all(failures):   # when every score failed, that is the message, not the prompts
            self.warn_if_no_signal(scores)

    def sampled(self, batch: Batch, scores: torch.Tensor, count: int = 3) -> list[dict]:
        """`count` rows of a batch as text, with their training scores: the first sample of
        each of the first prompts (a prompt's n samples are consecutive)."""
        picked = torch.arange(0, len(batch), int(batch.meta.get("n", 1)))[:count]
        rows = batch[picked]
        return [{"prompt": p, "response": r, "score": float(s)}
                for p, r, s in zip(prompt_texts(rows, self.tokenizer), response_texts(rows, self.tokenizer),
                                   scores[picked])]

    def stop_if_scoring_keeps_failing(self, failures: list[str | None], culprit: str = "the reward function",
                                      unit: str = "response", fix: str | None = None) -> None:
        """Raise ScoringFailed once --reward.max-failed-batches batches in a row had every
        row's scoring fail (`failures`: per row None, or why it failed): the run would go on
        learning from zeros and exit 0."""
        every_one_failed = bool(failures) and all(failures)
        self.failed_batches = self.failed_batches + 1 if every_one_failed else 0
        limit = self.cfg.max_failed_batches
        if limit and self.failed_batches >= limit:
            fix = fix or (f"fix --reward.fn {self.cfg.fn or 'arithmetic'} (a score function returns a real "
                          f"number, or a dict with one as 'score')")
            raise ScoringFailed(
                f"{culprit} failed on every {unit} of {self.failed_batches} batches in "
                f"a row ({len(failures)} of {len(failures)} in the last; first: {failures[0]}); "
                f"{fix}, or raise --reward.max-failed-batches (0: never stop)")

    def warn_if_no_signal(self, scores: torch.Tensor, first: int = 3) -> None:
        """Say so when every response of each of the first `first` batches scored the same: the
        advantages are all 0 and nothing is learned, which looks like a broken reward function
        but is usually the prompts."""
        if self.equal_batches < 0 or len(scores) == 0:
            return
        if scores.min() != scores.max():
            self.equal_batches = -1          # a signal came: never warn
            return
        self.equal_batches += 1
        if self.equal_batches == first:
            example = f" One of them: {self.samples[0]['prompt']!r} -> {self.samples[0]['response']!r}" \
                if self.samples else ""
            print(f"hflow: warning: every response scored {scores[0].item():g} in each of the first {first} "
                  f"batches, so every advantage is 0 and GRPO/PPO learn nothing. Likely causes: prompts in a "
                  f"format the model does not know (the embedded default wants bare '27+82=' prompts, not a "
                  f"chat template: drop --data.chat), --rollout.max-tokens too short to finish an answer, or "
                  f"a --data.answer-key column that is not the answer --reward.fn expects.{example}", flush=True)

    def close(self) -> None:
        self.rule.close()
        if self.judge is not None:
            self.judge.close()


def check_same_tokenizer(path, tokenizer, flag: str = "--reward.model") -> None:
    """A reward (or cost) model scores the policy's token ids: its tokenizer (when its
    directory has one) must be the policy's."""
    if not any((Path(path) / f).exists() for f in ("tokenizer.json", "tokenizer_config.json", "vocab.json")):
        return
    if AutoTokenizer.from_pretrained(path).get_vocab() != tokenizer.get_vocab():
        raise ValueError(f"{flag} {path}: its tokenizer is not the policy's; a reward model scores "
                         "the policy's token ids, so it must be trained with the policy's tokenizer")
