"""Supervised fine-tuning: prompt -> answer, loss on the answer tokens (+ EOS) only.

    torchrun --nproc-per-node 2 recipes/sft.py                      # the embedded default task
    torchrun --nproc-per-node 8 recipes/sft.py --model.path ~/models/Qwen2.5-0.5B \
        --data.train-files train.jsonl --data.val-files val.jsonl --data.answer-key answer \
        --reward.fn gsm8k --output-dir outputs/sft
    torchrun ... recipes/sft.py --help

The answer column (`--data.answer-key`) is the target completion; the held-out prompts are
scored with `--reward.fn` on greedy completions every `--eval-every` steps, and training stops
early once that reward reaches `--stop-at` (> 0). The result is exported as a Hugging Face
directory that `--model.path` of the RL recipes takes. This is the warm-up the embedded default
runs once (hflow.recipe.default_policy), as a recipe of its own.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import tyro

import hflow
from hflow.config import ActorConfig, DataConfig, ModelConfig, OptimConfig, RewardConfig
from hflow.recipe import policy_and_prompts, supervised_training
from hflow.rewards import Scorer
from hflow.workers import Actor, check_batch_sizes


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=lambda: DataConfig(batch_size=128))
    reward: RewardConfig = field(default_factory=RewardConfig)
    actor: ActorConfig = field(default_factory=lambda: ActorConfig(
        optim=OptimConfig(lr=1e-3, warmup_steps=100), micro_batch_size=128))
    steps: int = 1000
    """Optimizer steps (one batch of --data.batch-size examples each)."""
    eval_every: int = 50
    """Score greedy completions of the held-out prompts every this many steps."""
    eval_size: int = 500
    """Held-out prompts per evaluation."""
    stop_at: float = 0.0
    """Stop once the held-out reward reaches this (0: run every step)."""
    max_tokens: int = 16
    """Longest completion when evaluating."""
    output_dir: str = "outputs/sft"
    """The exported model goes to output_dir/model."""


def main(cluster: hflow.Cluster, cfg: Config):
    check_batch_sizes(cfg.data.batch_size, 1, cfg.actor.mini_batch_size, cluster.world_size)
    # the base model itself, not the embedded default's warmed-up one
    model_dir, tokenizer, train, val = policy_and_prompts(cluster, cfg.model, cfg.data, warm_up=False)
    actor = cluster.spawn(Actor, dataclasses.replace(cfg.actor, model_path=model_dir))
    reward = supervised_training(actor, train, val, tokenizer, Scorer(cfg.reward), cfg.steps,
                                 cfg.data.batch_size, cfg.eval_every, cfg.eval_size, cfg.stop_at,
                                 cfg.max_tokens, cfg.data.seed)
    actor.export_hf(f"{cfg.output_dir}/model", model_dir)
    print(f"held-out reward {reward:.3f}; model exported to {cfg.output_dir}/model")


if __name__ == "__main__":
    hflow.launch(main, tyro.cli(Config))
