"""What every recipe does the same way: the policy and prompts checked before any work, prompts
in, texts and scores out (a rule, a reward model in the loop, or both), the supervised loss. A recipe stays the algorithm; these are its
plumbing. (Held-out evaluation: hflow.evaluation; the embedded default's warm-up:
hflow.default_model; a run's bookkeeping: hflow.run.)
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers import AutoTokenizer

from hflow import algos
from hflow.batch import Batch
from hflow.config import ModelConfig
from hflow.data import DataConfig, Prompt, load_prompts
from hflow.rewards import RewardConfig, Scorer
from hflow.workers import RewardModel, RewardModelConfig
from hflow.layout import sequence_tensors


def policy_and_prompts(cluster, model: ModelConfig, data: DataConfig, warm_up: bool = True):
    """(policy directory, tokenizer, train prompts, held-out prompts), every input checked
    before any work starts; the embedded default policy is warmed up (once, cached) only after
    that, unless `warm_up` is False."""
    from hflow.default_model import default_model_dir, default_policy   # here: hflow.default_model imports this module

    path = Path(model.path) if model.path else default_model_dir(model.default_size, model.default_seed)
    check_policy_dir(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    train, val = load_prompts(data, tokenizer, "train"), load_prompts(data, tokenizer, "val")
    if not model.path and warm_up:
        path = default_policy(cluster, model.default_size, model.default_seed)
    return str(path), tokenizer, train, val


def check_policy_dir(path) -> None:
    """A Hugging Face directory of a model the engine and the workers support, or an error
    that says what to change."""
    from hflow.engine import SUPPORTED_MODEL_TYPES

    config = Path(path) / "config.json"
    if not config.exists():
        raise FileNotFoundError(f"--model.path {path}: not a Hugging Face model directory (no config.json)")
    model_type = json.loads(config.read_text()).get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"--model.path {path}: model_type {model_type!r} is not supported; "
                         f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}")


def prompt_batch(prompts: list[Prompt]) -> Batch:
    """The rows a sampler yields, as the Batch `Actor.generate` takes (ids + ground truths)."""
    return Batch({"prompt_ids": [p.prompt_ids for p in prompts],
                  "ground_truth": [p.ground_truth for p in prompts],
                  "extra": [p.extra for p in prompts]})


def response_texts(batch: Batch, tokenizer) -> list[str]:
    """The sampled responses as text, special tokens (EOS) dropped."""
    lengths = batch["response_mask"].sum(1).long().tolist()
    ids = [row[:n].tolist() for row, n in zip(batch["responses"], lengths)]
    return tokenizer.batch_decode(ids, skip_special_tokens=True)


def score(batch: Batch, tokenizer, scorer: Scorer) -> tuple[torch.Tensor, dict]:
    """One score per sequence of a rollout Batch, and the scorer's metrics (reward/*)."""
    scored = scorer(response_texts(batch, tokenizer), batch["ground_truth"], batch["extra"])
    return torch.tensor(scored.scores, dtype=torch.float32), scored.metrics


# ------------------------------------------------------------ rewards: a rule, a reward model, or both

def reward_roles(reward: RewardConfig, model: ModelConfig) -> list[str]:
    """["reward"] when a reward model is in the loop (a role to place like any model), else [];
    checks the flags before any work."""
    if reward.model == "default" and model.path:
        raise ValueError("--reward.model default is the embedded default policy's reward model; with "
                         "--model.path give a reward model trained for that policy's tokenizer "
                         "(recipes/reward_model.py)")
    if reward.model and reward.model != "default" and not (Path(reward.model) / "config.json").exists():
        raise FileNotFoundError(f"--reward.model {reward.model}: not a Hugging Face model directory (no config.json)")
    return ["reward"] if reward.model else []


class Rewards:
    """The training score of a rollout: the rule (--reward.fn) alone; with a reward model
    (--reward.model) w * rm, or rule + w * rm when --reward.fn is given too. The rule is
    always computed: it is logged, and held-out evaluation uses it (`rewards.rule`).

        plan = colocate(["actor", ...] + reward_roles(cfg.reward, cfg.model), world)
        rewards = Rewards(cluster, cfg.reward, cfg.model, tokenizer, plan.get("reward"))
        scores, metrics = rewards(batch)    # reward/mean; with a model also reward/rule_mean, reward/rm_mean, reward/rm_std
    """

    def __init__(self, cluster, cfg: RewardConfig, model: ModelConfig, tokenizer, ranks=None):
        from hflow.preference import default_reward_model   # here: hflow.preference imports hflow.default_model, which imports this module
        self.cfg, self.tokenizer, self.rule = cfg, tokenizer, Scorer(cfg)
        self.model = None
        self.equal_batches = 0   # batches so far whose responses all scored alike (the first few only)
        if cfg.model:
            path = default_reward_model(cluster, "reward", size=model.default_size, seed=model.default_seed) \
                if cfg.model == "default" else Path(cfg.model)
            check_same_tokenizer(path, tokenizer)
            rm_cfg = RewardModelConfig(model_path=str(path), max_tokens_per_micro_batch=cfg.model_max_tokens_per_micro_batch)
            self.model = cluster.spawn(RewardModel, rm_cfg, ranks=ranks)

    def __call__(self, batch: Batch) -> tuple[torch.Tensor, dict]:
        """One training score per sequence of a rollout Batch, and the metrics (reward/*)."""
        # the reward model works on its ranks while the controller applies the rule
        pending = self.model.scores.future(batch.select("input_ids", "attention_mask", "response_mask")) \
            if self.model else None
        rule, metrics = score(batch, self.tokenizer, self.rule)
        if pending is None:
            self.warn_if_no_signal(rule)
            return rule, metrics
        rm = pending.result()["rm_scores"]
        scores = self.cfg.model_weight * rm + (rule if self.cfg.fn else 0.0)
        self.warn_if_no_signal(scores)
        metrics["reward/rule_mean"] = metrics.pop("reward/mean")
        return scores, metrics | {"reward/mean": scores.mean().item(), "reward/rm_mean": rm.mean().item(),
                                  "reward/rm_std": rm.std().item() if len(rm) > 1 else 0.0}

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
            print(f"hflow: warning: every response scored {scores[0].item():g} in each of the first {first} "
                  f"batches, so every advantage is 0 and GRPO/PPO learn nothing. Likely causes: prompts in a "
                  f"format the model does not know (the embedded default wants bare '27+82=' prompts, not a "
                  f"chat template: drop --data.chat), --rollout.max-tokens too short to finish an answer, or "
                  f"a --data.answer-key column that is not the answer --reward.fn expects.", flush=True)

    def close(self) -> None:
        self.rule.close()


def check_same_tokenizer(path, tokenizer) -> None:
    """A reward model scores the policy's token ids: its tokenizer (when its directory has one)
    must be the policy's."""
    if not any((Path(path) / f).exists() for f in ("tokenizer.json", "tokenizer_config.json", "vocab.json")):
        return
    if AutoTokenizer.from_pretrained(path).get_vocab() != tokenizer.get_vocab():
        raise ValueError(f"--reward.model {path}: its tokenizer is not the policy's; a reward model scores "
                         "the policy's token ids, so it must be trained with the policy's tokenizer")


def rollout_metrics(batch: Batch) -> dict[str, float]:
    lengths = batch["response_mask"].sum(1)
    stopped = [reason == "stop" for reason in batch["finish_reason"]]
    return {"response_length/mean": lengths.mean().item(), "response_length/max": lengths.max().item(),
            "response/stop_fraction": sum(stopped) / max(len(stopped), 1)}


# ------------------------------------------------------------ supervised learning

def nll_loss(log_probs: torch.Tensor, mb: Batch, entropy=None):
    """Supervised loss: -mean log p(target token) over the response tokens."""
    loss = algos.aggregate_loss(-log_probs, mb["response_mask"], "token-mean")
    return loss, {}


def supervised_batch(prompts: list[Prompt], tokenizer) -> Batch:
    """Prompt + its ground truth as the target completion (ending with EOS), in the layout the
    Actor trains on."""
    targets = [tokenizer.encode(str(p.ground_truth), add_special_tokens=False) + [tokenizer.eos_token_id]
               for p in prompts]
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    return Batch(sequence_tensors([p.prompt_ids for p in prompts], targets, pad), meta={"n": 1})
