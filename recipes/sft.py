"""Supervised fine-tuning: prompt -> answer, loss on the answer tokens (+ EOS) only.

    torchrun --nproc-per-node 2 recipes/sft.py                      # the embedded default task
    torchrun --nproc-per-node 8 recipes/sft.py --model.path ~/models/Qwen2.5-0.5B \
        --data.train-files train.jsonl --data.val-files val.jsonl --data.answer-key answer \
        --reward.fn gsm8k --output-dir outputs/sft
    torchrun ... recipes/sft.py --help

The answer column (`--data.answer-key`) is the target completion; the held-out prompts are
scored with `--reward.fn` on greedy completions every `--eval-every` steps, and training stops
early once that reward reaches `--stop-at` (> 0). The result is exported as a Hugging Face
directory that `--model.path` of the RL recipes takes. The embedded default's warm-up
(hflow.default.warm_up.default_policy) runs the same loop, without gradient clipping
(`--actor.optim.grad-clip 0`), stopping at 50 % on 200 held-out prompts checked every 25 steps.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from transformers import AutoTokenizer

import hflow
from hflow.runtime import stopping
from hflow.algos import nll_loss
from hflow.recipe_kit.config import ActorConfig, DataConfig, ModelConfig, OptimConfig, RewardConfig, RolloutConfig
from hflow.data import PromptSampler, load_prompts
from hflow.default import EMBEDDED
from hflow.recipe_kit.evaluation import evaluate
from hflow.metrics import progress
from hflow.recipe_kit.set_up import base_policy
from hflow.rewards import Scorer
from hflow.recipe_kit.text_batches import supervised_batch
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
    model_dir = str(base_policy(cfg.model, EMBEDDED))
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    train, val = load_prompts(cfg.data, tokenizer, "train"), load_prompts(cfg.data, tokenizer, "val")
    actor = cluster.spawn(Actor, dataclasses.replace(cfg.actor, model_path=model_dir))
    scorer = Scorer(cfg.reward)
    sampler = PromptSampler(train, cfg.data.batch_size, shuffle=True, seed=cfg.data.seed)
    rollout = RolloutConfig(n=1, temperature=1.0, max_tokens=cfg.max_tokens, progress=False)
    reward, bar = float("nan"), progress(total=cfg.steps, desc="sft")
    for step in range(1, cfg.steps + 1):
        # the loss is on the answer (+ EOS) only: the prompt is given, not learned
        metrics = actor.update(supervised_batch(next(sampler), tokenizer), nll_loss)[0]
        bar.update(1)
        if step % cfg.eval_every == 0 or step == cfg.steps:   # greedy: what the RL recipes start from
            reward = evaluate(actor, val, tokenizer, scorer, rollout, cfg.eval_size, sampled=False).get(
                "eval/reward_mean", reward)
            print(f"sft step {step}: loss {metrics['actor/loss']:.4f}, held-out greedy reward {reward:.3f}")
            if reward >= cfg.stop_at > 0:
                break
        if stopping.requested():   # no checkpoints here: keep the model trained so far
            break
    bar.close()
    scorer.close()
    actor.export_hf(f"{cfg.output_dir}/model", model_dir)
    stopping.stop_if_asked(f"after sft step {step}; the model so far is exported to {cfg.output_dir}/model")
    print(f"held-out reward {reward:.3f}; model exported to {cfg.output_dir}/model")


if __name__ == "__main__":
    hflow.launch(main, Config)   # rank 0 parses and checks the flags
