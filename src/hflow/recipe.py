"""What every recipe does the same way: prompts in, texts out, evaluation, and the embedded
default policy. A recipe stays the algorithm; these are its plumbing.
"""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
from pathlib import Path

import torch

from hflow import algos
from hflow.batch import Batch
from hflow.config import ModelConfig
from hflow.data import DataConfig, Prompt, PromptDataset, PromptSampler, iter_batches, load_prompts
from hflow.metrics import progress
from hflow.rewards import RewardConfig, Scorer
from hflow.workers import Actor, ActorConfig, RolloutConfig
from hflow.workers.layout import sequence_tensors


def policy_and_prompts(cluster, model: ModelConfig, data: DataConfig, warm_up: bool = True):
    """(policy directory, tokenizer, train prompts, held-out prompts), every input checked
    before any work starts; the embedded default policy is warmed up (once, cached) only after
    that, unless `warm_up` is False."""
    from transformers import AutoTokenizer

    from hflow.default_model import default_model_dir

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


def rollout_metrics(batch: Batch) -> dict[str, float]:
    lengths = batch["response_mask"].sum(1)
    stopped = [reason == "stop" for reason in batch["finish_reason"]]
    return {"response_length/mean": lengths.mean().item(), "response_length/max": lengths.max().item(),
            "response/stop_fraction": sum(stopped) / max(len(stopped), 1)}


def evaluate(actor, dataset: PromptDataset | None, tokenizer, scorer: Scorer, rollout: RolloutConfig,
             size: int, batch_size: int = 512, sampled: bool = True) -> dict[str, float]:
    """Mean reward on the first `size` held-out prompts: greedy (eval/reward_mean) and, unless
    `sampled` is False, one sample at the rollout temperature (eval/reward_mean_sampled)."""
    if dataset is None or size <= 0:
        return {}
    configs = {"eval/reward_mean": dataclasses.replace(rollout, n=1, temperature=0.0, progress=False)}
    if sampled:
        configs["eval/reward_mean_sampled"] = dataclasses.replace(rollout, n=1, progress=False)
    totals = dict.fromkeys(configs, 0.0)
    count = 0
    for rows in iter_batches(dataset, batch_size):
        rows = rows[:size - count]
        prompts = prompt_batch(rows)
        for key, cfg in configs.items():
            scores, _ = score(actor.generate(prompts, cfg), tokenizer, scorer)
            totals[key] += scores.sum().item()
        count += len(rows)
        if count >= size:
            break
    return {key: total / count for key, total in totals.items()}


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


def supervised_training(actor, train: PromptDataset, val: PromptDataset | None, tokenizer, scorer: Scorer,
                        steps: int, batch_size: int, eval_every: int, eval_size: int, stop_at: float,
                        max_tokens: int, seed: int = 0, log=print) -> float:
    """Train `actor` on prompt -> ground truth until `steps` are done or the greedy held-out
    reward reaches `stop_at` (checked every `eval_every` steps). Returns the last eval reward."""
    sampler = PromptSampler(train, batch_size, shuffle=True, seed=seed)
    rollout = RolloutConfig(n=1, temperature=1.0, max_tokens=max_tokens, progress=False)
    reward = float("nan")
    bar = progress(total=steps, desc="sft")
    for step in range(1, steps + 1):
        metrics = actor.update(supervised_batch(next(sampler), tokenizer), nll_loss)[0]
        bar.update(1)
        if step % eval_every == 0 or step == steps:
            reward = evaluate(actor, val, tokenizer, scorer, rollout, eval_size, sampled=False).get(
                "eval/reward_mean", reward)
            log(f"sft step {step}: loss {metrics['actor/loss']:.4f}, held-out greedy reward {reward:.3f}")
            if reward >= stop_at > 0:
                break
    bar.close()
    return reward


# Bump whenever anything changes what the warm-up produces (its settings below, or code that changes
# its numbers): the cached policy's directory carries it, so an old cache is not silently reused.
WARM_UP_VERSION = 2


def default_policy_dir(size: str = "default", seed: int = 0, stop_at: float = 0.5, cache_dir=None) -> Path:
    """Where `default_policy` caches the warmed-up embedded default (the base model is built here
    if it is not cached yet; the warm-up is not run)."""
    from hflow.default_model import default_model_dir

    base = default_model_dir(size, seed, cache_dir)
    return base.with_name(f"{base.name}-sft{stop_at:g}-w{WARM_UP_VERSION}")


def default_policy(cluster, size: str = "default", seed: int = 0, stop_at: float = 0.5,
                   max_steps: int = 1500, cache_dir=None) -> Path:
    """The embedded default policy: hflow's own small Qwen2 model, supervised on the built-in
    arithmetic task until its greedy held-out accuracy reaches `stop_at` (RL gets almost no
    signal from a policy that is never right). Built once and cached, like the model itself.

    No gradient clipping: clipped at norm 1 (the RL default) the loss sits on a plateau near
    10 % accuracy for ~800 steps; unclipped it leaves it after ~400 (500 steps in all to 0.5)."""
    from transformers import AutoTokenizer

    from hflow.default_model import default_model_dir

    base = default_model_dir(size, seed, cache_dir)
    final = default_policy_dir(size, seed, stop_at, cache_dir)
    if (final / "config.json").exists():
        return final
    tokenizer = AutoTokenizer.from_pretrained(base)
    data = DataConfig(task="arithmetic", task_seed=seed)
    train, val = load_prompts(data, tokenizer, "train"), load_prompts(data, tokenizer, "val")
    optim = dataclasses.replace(ActorConfig().optim, lr=1e-3, warmup_steps=100, grad_clip=0.0)
    cfg = ActorConfig(model_path=str(base), optim=optim, micro_batch_size=128)
    actor = cluster.spawn(Actor, cfg)
    print(f"warming up the embedded default model ({base.name}) until held-out accuracy {stop_at}"
          f" (once; cached in {final})", flush=True)
    scorer = Scorer(RewardConfig(fn="arithmetic"))
    reward = supervised_training(actor, train, val, tokenizer, scorer,
                                 steps=max_steps, batch_size=128, eval_every=25, eval_size=200,
                                 stop_at=stop_at, max_tokens=5, seed=seed)
    scorer.close()
    tmp = final.with_name(final.name + f".tmp{os.getpid()}")
    actor.export_hf(str(tmp), str(base))
    actor.close()   # the recipe spawns its own workers on the warmed-up policy
    if reward < stop_at:
        raise RuntimeError(f"the warm-up reached held-out accuracy {reward:.3f} < {stop_at} in {max_steps} steps")
    shutil.rmtree(final, ignore_errors=True)
    os.rename(tmp, final)
    return final
