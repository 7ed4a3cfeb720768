"""Reward model (Bradley–Terry; Ouyang et al. 2022) or Safe-RLHF cost model (Dai et al. 2023)
from preference pairs: a sequence classifier with one output, trained with FSDP2.

    torchrun --nproc-per-node 2 recipes/reward_model.py             # the embedded default's arithmetic pairs
    torchrun --nproc-per-node 2 recipes/reward_model.py --cost      # its safety pairs: a cost model
    torchrun --nproc-per-node 8 recipes/reward_model.py --model.path ~/models/Qwen2.5-0.5B-Instruct \
        --data.train-files hh-rlhf/train.jsonl --data.val-files hh-rlhf/test.jsonl --data.prompt-key '' \
        --rm.optim.lr 1e-5 --data.max-length 1024
    torchrun ... recipes/reward_model.py --help                      # every flag, grouped

The model starts from `--model.path` (a causal LM, e.g. the policy, gets a new score head; a
sequence classifier keeps its head). Its score r(x, y) is the head's output at the last token of
prompt + response + EOS. Each step takes `--data.batch-size` pairs and minimises

    reward model: L = −mean log σ(r(x, y_chosen) − r(x, y_rejected)) + λ mean r² / 2   (Bradley–Terry, centred)
    cost model:   L = −mean [log σ(c_unsafer − c_safer) + log σ(s_safer c_safer) + log σ(s_unsafer c_unsafer)]

with s = +1 for an unsafe response, −1 for a safe one (the cost is > 0 exactly on unsafe ones).
The centering term (`--center-coef`) gives a reward the same zero on every prompt: Bradley–Terry
alone leaves each prompt a free offset, which PPO's critic would have to learn before its
advantages mean anything (with the embedded default's reward model uncentred, the critic
explained none of the score's variance and PPO drifted away from right answers).
Held-out pair accuracy and mean margin (a cost model: also sign accuracy) are reported before
training, every `--eval-every` steps and at the end; the model is exported as a Hugging Face
directory (`<output-dir>/model`, AutoModelForSequenceClassification) that `--reward.model` of the
RL recipes takes.

Data (`--data.*`): jsonl / parquet / csv files, one pair a row, the columns named by flags:

- prompt / chosen / rejected text columns (the defaults). The prompt may be chat messages, or a
  string rendered as one user message with `--data.chat`.
- HH-RLHF (`Anthropic/hh-rlhf`): `chosen` and `rejected` are whole dialogues ("\n\nHuman: ...
  \n\nAssistant: ...") that differ in the last answer: `--data.prompt-key ''` (their longest
  common token prefix becomes the prompt).
- PKU-SafeRLHF (`PKU-Alignment/PKU-SafeRLHF`): `prompt`, `response_0`, `response_1`,
  `better_response_id`, `safer_response_id`, `is_response_0_safe`, `is_response_1_safe`.
  A reward model: `--data.chosen-key response_0 --data.rejected-key response_1
  --data.preferred-key better_response_id`; a cost model: `--cost --data.chosen-key response_0
  --data.rejected-key response_1 --data.preferred-key safer_response_id
  --data.chosen-safe-key is_response_0_safe --data.rejected-safe-key is_response_1_safe`
  (the preferred column, 0 or 1, says which response is chosen; responses and labels swap on 1).

No `--data.val-files`: the last `--data.val-fraction` of the pairs is held out. No files at all:
the embedded default's pairs and backbone, as `hflow.default.judges.default_reward_model` builds them:
the right answer over the warmed-up policy's own sampled mistakes, over a built-in wrong answer
(a wrong units or tens digit, the other operation, a malformed response) and over the near
misses answer ± 1 and ± 10 (without them PPO learns the ones the judge rates right), on a
backbone supervised to 0.95 held-out accuracy (a judge must know more than the 0.5 policy it
judges: one started from the policy shares its blind spots and PPO learns to exploit them);
`--cost`: the safety task's pairs (hflow.data.safety). The cached `--reward.model default`
trains 1500 steps (`hflow.default.DEFAULT_JUDGES`), this recipe `--steps`.

Supports: any Llama-family causal LM or sequence classifier, data-parallel training on any
number of ranks (a rank trains on whole pairs), chat-template prompts. Not: per-token (dense)
reward models, the score regulariser of some implementations, several epochs over a batch.
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field

from transformers import AutoTokenizer

import hflow
from hflow import layout
from hflow.runtime import stopping
from hflow.recipe_kit.config import ModelConfig, OptimConfig
from hflow.data import PromptSampler
from hflow.algos import pair_loss
from hflow.data.preference import PairDataConfig, pair_batch, read_pair_rows, tokenize_pairs
from hflow.default import DEFAULT_JUDGES, EMBEDDED, default_pair_rows, default_policy
from hflow.recipe_kit.evaluation import evaluate_pairs
from hflow.metrics import LoggingConfig, MetricsLogger
from hflow.recipe_kit.set_up import base_policy
from hflow.workers import RewardModel, RewardModelConfig


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: PairDataConfig = field(default_factory=PairDataConfig)
    rm: RewardModelConfig = field(default_factory=lambda: RewardModelConfig(
        optim=OptimConfig(lr=1e-4, warmup_steps=20), micro_batch_size=64))
    cost: bool = False
    """Train a Safe-RLHF cost model (ranking + sign terms; needs the safety label columns) instead of a reward model."""
    center_coef: float = 0.05
    """λ of the centering term λ · mean(r²) / 2 of a reward model's loss: a pair's scores sit at ±margin / 2, so that a score's 0 means the same on every prompt (0: plain Bradley–Terry)."""
    steps: int = 1000
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
    path = base_policy(cfg.model, EMBEDDED)
    tokenizer = AutoTokenizer.from_pretrained(path)
    kind, size, seed = "cost" if cfg.cost else "reward", cfg.model.default_size, cfg.model.default_seed
    if cfg.data.train_files:
        train, val = (read_pair_rows(cfg.data, split, cfg.cost) for split in ("train", "val"))
    else:   # the embedded default's pairs: for a reward model, against the warmed-up policy's own mistakes
        train, val = default_pair_rows(cluster, kind, size, seed)
    train, val = tokenize_pairs(train, tokenizer, cfg.data), tokenize_pairs(val, tokenizer, cfg.data)
    if len(train) < cfg.data.batch_size:
        raise ValueError(f"--data.batch-size {cfg.data.batch_size} is more than the {len(train)} training pairs")
    if not cfg.model.path:   # a judge that knows more than the policy it will judge (cached warm-up)
        path = default_policy(cluster, size, seed, DEFAULT_JUDGES[kind].backbone_accuracy)
    rm = cluster.spawn(RewardModel, dataclasses.replace(cfg.rm, model_path=str(path), trainable=True))
    pad_id = layout.pad_id(tokenizer)
    sampler = PromptSampler(train, cfg.data.batch_size, shuffle=True, seed=cfg.data.seed)
    loss_fn = functools.partial(pair_loss, cost=cfg.cost, center_coef=cfg.center_coef)
    logger = MetricsLogger(cfg.output_dir, cfg.logging, cfg.steps)
    logger.log(0, evaluate_pairs(rm, val, pad_id, cfg.cost))   # a new head ranks at chance
    for step in range(1, cfg.steps + 1):
        # chosen and rejected of a pair sit in one micro-batch: the loss compares their scores
        metrics = rm.update(pair_batch(next(sampler), pad_id), loss_fn)[0]
        if step % cfg.eval_every == 0 or step == cfg.steps:
            metrics |= evaluate_pairs(rm, val, pad_id, cfg.cost)
        logger.log(step, metrics)
        if stopping.requested():   # no checkpoints here: keep the model trained so far
            break
    rm.export_hf(f"{cfg.output_dir}/model", str(path))
    logger.close()
    stopping.stop_if_asked(f"after step {step}; the model so far is exported to {cfg.output_dir}/model")
    print(f"held-out pair accuracy {metrics['eval/pair_accuracy']:.3f}; model exported to {cfg.output_dir}/model")


if __name__ == "__main__":
    hflow.launch(main, Config)   # rank 0 parses and checks the flags
