"""Direct preference optimisation (DPO; Rafailov et al. 2023) or IPO (Azar et al. 2023): the policy
trained offline on preference pairs against a frozen reference, with FSDP2.

    torchrun --nproc-per-node 2 recipes/dpo.py                      # the embedded default's arithmetic pairs
    torchrun --nproc-per-node 2 recipes/dpo.py --dpo.loss ipo       # IPO on the same pairs
    torchrun --nproc-per-node 8 recipes/dpo.py --model.path ~/models/Qwen2.5-0.5B-Instruct \
        --data.train-files hh-rlhf/train.jsonl --data.val-files hh-rlhf/test.jsonl --data.prompt-key '' \
        --actor.optim.lr 5e-7 --data.max-length 1024
    torchrun ... recipes/dpo.py --help                              # every flag, grouped

The policy starts from `--model.path` and so does the reference, which is frozen: it scores every
training and held-out pair once, before the first step (log π_ref(y|x), summed over the response
tokens + EOS), and is closed; the steps reuse those numbers, epoch after epoch. Each step takes
`--data.batch-size` pairs, keeps a pair's chosen and rejected responses in one micro-batch, and
minimises the mean over pairs of (TRL's DPOTrainer, loss_type "sigmoid" / "ipo")

    sigmoid: L = −log σ(β (h_chosen − h_rejected))                  h = log π(y|x) − log π_ref(y|x)
    ipo:     L = (h_chosen / n_chosen − h_rejected / n_rejected − 1 / (2β))²   n: the response's tokens

with β = `--dpo.beta`. Logged as TRL names them, prefixed by where they come from (actor/ for the
training batch, eval/ for the held-out pairs): loss, rewards/chosen and rewards/rejected (the
implicit rewards β h), rewards/accuracies (share of pairs with the chosen one's higher),
rewards/margins, logps/chosen and logps/rejected; on the held-out pairs before training (loss
log 2 for sigmoid, rewards 0), every `--eval-every` steps and at the end; ref/pairs and
ref/calls (step 0): what the reference scored, once. The policy is exported as a Hugging Face
directory (`<output-dir>/model`) that `--model.path` of the other recipes takes.

Data (`--data.*`): preference pairs as recipes/reward_model.py reads them (prompt / chosen /
rejected columns, chat-message prompts with `--data.chat`, HH-RLHF's whole dialogues with
`--data.prompt-key ''`, PKU-SafeRLHF's columns with `--data.preferred-key`; see its docstring).
No files: the embedded default's warmed-up policy (hflow.default.warm_up, which answers half the
held-out problems) on the reward model's pairs, the right answer over the policy's own sampled
mistakes, a built-in wrong answer and the near misses answer ± 1 and ± 10.

`--actor.micro-batch-size` counts pairs here (each is two sequences), as
`--actor.max-tokens-per-micro-batch` counts a pair's tokens together. Supports: any Llama-family
causal LM, LoRA (`--actor.lora.*`), data-parallel training on any number of ranks dividing the
pairs per step. Not: several epochs or mini-batches over a batch (one optimizer step per batch),
other TRL loss types, label smoothing, the reference refreshed during training, checkpoints (the
policy trained so far is exported when a run is stopped).
"""
from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass, field
from typing import Literal

import torch
from transformers import AutoTokenizer

import hflow
from hflow import layout
from hflow.algos import dpo_loss, dpo_metrics, dpo_pair_loss, sequence_log_probs
from hflow.batch import Batch
from hflow.data import PromptSampler
from hflow.data.preference import PairDataConfig, pair_batch, read_pair_rows, tokenize_pairs
from hflow.default import EMBEDDED, default_pair_rows, default_policy
from hflow.metrics import LoggingConfig, MetricsLogger
from hflow.recipe_kit.config import ActorConfig, ModelConfig, OptimConfig
from hflow.recipe_kit.set_up import base_policy
from hflow.runtime import stopping
from hflow.workers import Actor, Reference


SCORING_PAIRS = 512   # pairs per call of the reference's (and the held-out evaluation's) log-probs


@dataclass
class DPOConfig:
    """The preference loss (--dpo.*)."""

    beta: float = 0.1
    """β: the strength of the pull towards the reference (TRL's default 0.1); IPO's τ."""
    loss: Literal["sigmoid", "ipo"] = "sigmoid"
    """sigmoid: DPO's −log σ(β Δh); ipo: IPO's (Δ of the token-averaged log-ratios − 1/(2β))²."""


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: PairDataConfig = field(default_factory=PairDataConfig)
    actor: ActorConfig = field(default_factory=lambda: ActorConfig(
        optim=OptimConfig(lr=1e-4, warmup_steps=10), micro_batch_size=32))
    dpo: DPOConfig = field(default_factory=DPOConfig)
    steps: int = 200
    """Optimizer steps (one batch of --data.batch-size pairs each)."""
    eval_every: int = 50
    """Report the held-out pairs' loss and rewards every this many steps (and at the end)."""
    output_dir: str = "outputs/dpo"
    """metrics.jsonl goes here, the exported policy to output_dir/model."""
    logging: LoggingConfig = field(default_factory=lambda: LoggingConfig(console_keys=(
        "actor/loss", "actor/rewards/accuracies", "actor/rewards/margins", "eval/loss", "eval/rewards/accuracies",
        "eval/rewards/margins", "actor/grad_norm")))


class PairActor(Actor):
    """The policy, its training micro-batches whole pairs: pair i is rows 2i, 2i + 1 (as the
    RewardModel splits them), so that a loss compares a pair's chosen and rejected responses."""

    def micro_batches(self, tensors: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        if "chosen" not in tensors or len(tensors["chosen"]) % 2:
            return super().micro_batches(tensors)
        mask = tensors["attention_mask"]
        pairs = super().micro_batches({"attention_mask": torch.cat([mask[0::2], mask[1::2]], dim=1)})
        return [torch.stack([2 * p, 2 * p + 1], dim=1).flatten() for p in pairs]


def with_reference(ref, pairs: list[tuple], pad_id: int, batch_size: int) -> tuple[list[tuple], int]:
    """Each pair with its chosen and rejected responses' reference log-probs (summed over the
    response) appended: one pass of the reference over the pairs. Returns the pairs and the calls."""
    out, calls = [], 0
    for start in range(0, len(pairs), batch_size):
        part = pairs[start:start + batch_size]
        batch = pair_batch(part, pad_id)
        logp, _ = sequence_log_probs(ref.log_probs(batch)["ref_log_probs"], batch["response_mask"])
        out += [p[:5] + (c, r) for p, (c, r) in zip(part, logp.view(-1, 2).tolist())]
        calls += 1
    return out, calls


def dpo_batch(pairs: list[tuple], pad_id: int) -> Batch:
    """pair_batch's layout (pair i = rows 2i chosen, 2i + 1 rejected; meta n = 2 keeps a pair on
    one rank) plus `ref_logp` [2B], each row's cached reference log-prob."""
    batch = pair_batch(pairs, pad_id)
    batch["ref_logp"] = torch.tensor([x for p in pairs for x in p[5:7]], dtype=torch.float32)
    return batch


def evaluate_dpo(actor, pairs: list[tuple], pad_id: int, dpo: DPOConfig, batch_size: int) -> dict[str, float]:
    """The held-out pairs' eval/loss and eval/rewards/*, eval/logps/* under the current policy."""
    logp, tokens = [], []
    for start in range(0, len(pairs), batch_size):
        batch = dpo_batch(pairs[start:start + batch_size], pad_id)
        summed, count = sequence_log_probs(actor.log_probs(batch)["old_log_probs"], batch["response_mask"])
        logp.append(summed.view(-1, 2))
        tokens.append(count.view(-1, 2))
    logp, tokens = torch.cat(logp).double(), torch.cat(tokens).double()
    ref = torch.tensor([p[5:7] for p in pairs], dtype=torch.float64)
    loss = dpo_loss(logp[:, 0], logp[:, 1], ref[:, 0], ref[:, 1], dpo.beta, dpo.loss, tokens[:, 0], tokens[:, 1])
    metrics = {"loss": loss.mean().item()} | dpo_metrics(logp[:, 0], logp[:, 1], ref[:, 0], ref[:, 1], dpo.beta)
    return {f"eval/{k}": v for k, v in metrics.items()}


def main(cluster: hflow.Cluster, cfg: Config):
    if cfg.data.batch_size % cluster.world_size:
        raise ValueError(f"--data.batch-size {cfg.data.batch_size} pairs do not split over {cluster.world_size} "
                         "ranks: a rank trains on whole pairs")
    if cfg.actor.epochs != 1 or cfg.actor.mini_batch_size not in (0, cfg.data.batch_size):
        raise ValueError("DPO takes one optimizer step per batch of pairs: --actor.epochs 1 and "
                         "--actor.mini-batch-size 0")
    if cfg.dpo.beta <= 0:
        raise ValueError(f"--dpo.beta must be > 0, got {cfg.dpo.beta}")
    tokenizer = AutoTokenizer.from_pretrained(base_policy(cfg.model, EMBEDDED))
    size, seed = cfg.model.default_size, cfg.model.default_seed
    if cfg.data.train_files:
        train, val = (read_pair_rows(cfg.data, split) for split in ("train", "val"))
    else:   # the embedded default's reward-model pairs: right answers over the warmed-up policy's own mistakes
        train, val = default_pair_rows(cluster, "reward", size, seed)
    train, val = tokenize_pairs(train, tokenizer, cfg.data), tokenize_pairs(val, tokenizer, cfg.data)
    if len(train) < cfg.data.batch_size:
        raise ValueError(f"--data.batch-size {cfg.data.batch_size} is more than the {len(train)} training pairs")
    path = str(base_policy(cfg.model) if cfg.model.path else default_policy(cluster, size, seed))
    actor_cfg = dataclasses.replace(cfg.actor, model_path=path)
    pad_id = layout.pad_id(tokenizer)

    # 1. the reference scores every pair once, then goes: the steps reuse its log-probs
    ref = cluster.spawn(Reference, actor_cfg)
    (train, train_calls), (val, val_calls) = (with_reference(ref, pairs, pad_id, SCORING_PAIRS)
                                              for pairs in (train, val))
    ref.close()
    actor = cluster.spawn(PairActor, actor_cfg)
    sampler = PromptSampler(train, cfg.data.batch_size, shuffle=True, seed=cfg.data.seed)
    loss_fn = functools.partial(dpo_pair_loss, beta=cfg.dpo.beta, loss=cfg.dpo.loss)
    logger = MetricsLogger(cfg.output_dir, cfg.logging, cfg.steps)
    logger.log(0, {"ref/pairs": float(len(train) + len(val)), "ref/calls": float(train_calls + val_calls)}
               | evaluate_dpo(actor, val, pad_id, cfg.dpo, SCORING_PAIRS))
    for step in range(1, cfg.steps + 1):
        # 2. the next pairs, each with its cached reference log-probs
        batch = dpo_batch(next(sampler), pad_id)
        # 3. one optimizer step on the mean pair loss (a pair's two rows weigh one pair)
        metrics = actor.update(batch, loss_fn, temperature=1.0, loss_agg="seq-mean-token-mean")[0]
        # 4. the held-out pairs under the updated policy
        if step % cfg.eval_every == 0 or step == cfg.steps:
            metrics |= evaluate_dpo(actor, val, pad_id, cfg.dpo, SCORING_PAIRS)
        logger.log(step, metrics)
        if stopping.requested():   # no checkpoints here: keep the policy trained so far
            break
    actor.export_hf(f"{cfg.output_dir}/model", path)
    logger.close()
    stopping.stop_if_asked(f"after step {step}; the policy so far is exported to {cfg.output_dir}/model")
    last = metrics.get("eval/rewards/accuracies", math.nan)
    print(f"held-out reward accuracy {last:.3f}; policy exported to {cfg.output_dir}/model")


if __name__ == "__main__":
    hflow.launch(main, Config)   # rank 0 parses and checks the flags
