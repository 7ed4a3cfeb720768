"""Reward model (Bradley–Terry; Ouyang et al. 2022) or Safe-RLHF cost model (Dai et al. 2023)
from preference pairs: a sequence classifier with one output, trained with FSDP2.

    torchrun --nproc-per-node 2 recipes/reward_model.py             # the embedded default's arithmetic pairs
    torchrun --nproc-per-node 2 recipes/reward_model.py --cost      # its safety pairs: a cost model
    torchrun --nproc-per-node 8 recipes/reward_model.py --model.path ~/models/Qwen2.5-0.5B-Instruct \
        --data.train-files hh-rlhf/train.jsonl --data.val-files hh-rlhf/test.jsonl --data.prompt-key '' \
        --rm.optim.lr 1e-5 --data.max-length 1024
    torchrun ... recipes/reward_model.py --help                      # every flag, grouped

The model starts from `--model.path` (a causal LM, e.g. the policy, gets a new score head; a
sequence classifier keeps its head) — by default the embedded default's warmed-up policy, so that
the reward model reads the policy's tokens with the policy's features. Its score r(x, y) is the
head's output at the last token of prompt + response (+ EOS). Each step takes `--data.batch-size`
pairs and minimises

    reward model: L = −mean log σ(r(x, y_chosen) − r(x, y_rejected))                  (Bradley–Terry)
    cost model:   L = −mean [log σ(c_unsafer − c_safer) + log σ(s_safer c_safer) + log σ(s_unsafer c_unsafer)]

with s = +1 for an unsafe response, −1 for a safe one (the cost is > 0 exactly on unsafe ones).
Held-out pair accuracy (and mean margin; sign accuracy for a cost model) is reported every
`--eval-every` steps and at the end; the model is exported as a Hugging Face directory
(`<output-dir>/model`, AutoModelForSequenceClassification) that `--reward.model` of the RL
recipes takes.

Data (`--data.*`): jsonl / parquet / csv, one pair a row, the columns named by flags. The
layouts of HH-RLHF (chosen / rejected whole dialogues: `--data.prompt-key ''`) and PKU-SafeRLHF
(`prompt`, `response_0`, `response_1`, `better_response_id`, `safer_response_id`,
`is_response_0_safe`, `is_response_1_safe`) and the flags for each are in
hflow/data/preference.py. With no files: the embedded default's pairs (a right answer over a near
miss or a malformed one; `--cost`: hflow.data.safety's pairs).

Supports: any Llama-family causal LM or sequence classifier, colocated data-parallel training on
any number of ranks, chat-template prompts. Not: per-token (dense) reward models, the score
regulariser of some implementations, several epochs over a batch.
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field

from transformers import AutoTokenizer

import hflow
from hflow.config import ModelConfig, OptimConfig
from hflow.data import PromptSampler
from hflow.data.preference import PairDataConfig, pair_batch, read_pair_rows, tokenize_pairs
from hflow.default_model import default_model_dir, default_policy
from hflow.metrics import LoggingConfig, MetricsLogger
from hflow.preference import evaluate_pairs, pair_loss
from hflow.recipe import check_policy_dir
from hflow.workers import RewardModel, RewardModelConfig


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: PairDataConfig = field(default_factory=PairDataConfig)
    rm: RewardModelConfig = field(default_factory=lambda: RewardModelConfig(
        optim=OptimConfig(lr=3e-4, warmup_steps=20), micro_batch_size=64))
    cost: bool = False
    """Train a Safe-RLHF cost model (ranking + sign terms; needs the safety label columns) instead of a reward model."""
    steps: int = 600
    """Optimizer steps (one batch of --data.batch-size pairs each)."""
    eval_every: int = 100
    """Report held-out pair accuracy every this many steps (and at the end)."""
    output_dir: str = "outputs/reward_model"
    """metrics.jsonl goes here, the exported model to output_dir/model."""
    logging: LoggingConfig = field(default_factory=lambda: LoggingConfig(console_keys=(
        "rm/loss", "rm/accuracy", "eval/pair_accuracy", "eval/pair_margin", "eval/sign_accuracy", "rm/grad_norm")))


def main(cluster: hflow.Cluster, cfg: Config):
    if cfg.data.batch_size % cluster.world_size:
        raise ValueError(f"--data.batch-size {cfg.data.batch_size} pairs do not split over {cluster.world_size} "
                         "ranks: a rank trains on whole pairs")
    path = cfg.model.path or default_model_dir(cfg.model.default_size, cfg.model.default_seed)
    check_policy_dir(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    train, val = (tokenize_pairs(read_pair_rows(cfg.data, split, cfg.cost), tokenizer, cfg.data)
                  for split in ("train", "val"))
    if len(train) < cfg.data.batch_size:
        raise ValueError(f"--data.batch-size {cfg.data.batch_size} is more than the {len(train)} training pairs")
    if not cfg.model.path:   # the embedded default: start from the warmed-up policy (once, cached)
        path = default_policy(cluster, cfg.model.default_size, cfg.model.default_seed)
    rm = cluster.spawn(RewardModel, dataclasses.replace(cfg.rm, model_path=str(path), trainable=True))
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    sampler = PromptSampler(train, cfg.data.batch_size, shuffle=True, seed=cfg.data.seed)
    loss_fn = functools.partial(pair_loss, cost=cfg.cost)
    logger = MetricsLogger(cfg.output_dir, cfg.logging, cfg.steps)
    logger.log(0, evaluate_pairs(rm, val, pad_id, cfg.cost))   # a new head ranks at chance
    for step in range(1, cfg.steps + 1):
        # chosen and rejected of a pair sit in one micro-batch: the loss compares their scores
        metrics = rm.update(pair_batch(next(sampler), pad_id), loss_fn)[0]
        if step % cfg.eval_every == 0 or step == cfg.steps:
            metrics |= evaluate_pairs(rm, val, pad_id, cfg.cost)
        logger.log(step, metrics)
    rm.export_hf(f"{cfg.output_dir}/model", str(path))
    logger.close()
    print(f"held-out pair accuracy {metrics['eval/pair_accuracy']:.3f}; model exported to {cfg.output_dir}/model")


if __name__ == "__main__":
    hflow.launch(main, Config)   # rank 0 parses and checks the flags
