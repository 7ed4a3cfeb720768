"""A generative judge's part of the training score (--reward.judge): the controller's side.

    judge = JudgeReward(cluster, cfg.reward, placement.get("judge"))    # spawns the Judge role
    pending = judge.request(batch, tokenizer)          # renders the prompts, sends them; returns at once
    scores, failures, metrics = judge.result(pending)  # [B] in [0, 1], per row None or why unparsable

metrics: reward/judge_mean, reward/judge_unparsable (the fraction of verdicts the parse rule
could not read), reward/judge_unparsable_count, reward/judge_verdicts_per_s and
reward/judge_tokens_per_s (verdict tokens written; both over the slowest rank's time, waking
and sleeping included), reward/judge_prompt_tokens (mean per verdict).
"""
from __future__ import annotations

from pathlib import Path

import torch

from hflow.batch import Batch
from hflow.engine.models.transformers_fallback import why_not_runnable
from hflow.pretrained import resolve_model
from hflow.recipe_kit.text_batches import response_texts
from hflow.rewards import RewardConfig
from hflow.rewards.judge import default_template, load_template, parse_verdict, render
from hflow.validation import ConfigError, read_json_object
from hflow.workers.judge import Judge, JudgeConfig


def judge_model_dir(cfg: RewardConfig) -> Path:
    """--reward.judge as a Hugging Face directory of a model the engine runs, or a ConfigError."""
    path = resolve_model(cfg.judge, "--reward.judge")
    model_type = read_json_object(Path(path) / "config.json", f"--reward.judge {cfg.judge}").get("model_type")
    refusal = why_not_runnable(model_type)
    if refusal is not None:
        raise ConfigError(f"--reward.judge {cfg.judge}: model_type {model_type!r} is not supported: {refusal}")
    return path


def judge_flag_problems(cfg: RewardConfig, placement: str = "colocate") -> list[str]:
    """What is wrong with the --reward.judge* flags (and a --trainer.placement that cannot hold a
    judge), before any work (one line each)."""
    found = []
    if cfg.judge and placement.strip() == "auto":
        found.append("--trainer.placement auto does not plan a judge yet (the planner has no model of its cost): "
                     "name a placement with --reward.judge: colocate, split, standalone or a SPEC")
    if cfg.judge_template and not cfg.judge:
        found.append(f"--reward.judge-template {cfg.judge_template}: given without --reward.judge "
                     f"(the model it prompts)")
    for check in ((lambda: judge_model_dir(cfg)) if cfg.judge else None,
                  (lambda: load_template(cfg.judge_template)) if cfg.judge_template else None):
        try:
            check and check()
        except ConfigError as e:
            found.append(str(e))
    return found


def judged_prompt_texts(batch: Batch, tokenizer) -> list[str]:
    """Each row's prompt as the judge reads it: the prompt's own text when the batch carries it,
    else its ids decoded without special tokens (a chat template's role names stay)."""
    if "prompt" in batch and all(isinstance(p, str) for p in batch["prompt"]):
        return list(batch["prompt"])
    start = batch["input_ids"].shape[1] - batch["responses"].shape[1]
    ids = [row[:start][mask[:start].bool()].tolist() for row, mask in zip(batch["input_ids"], batch["attention_mask"])]
    return tokenizer.batch_decode(ids, skip_special_tokens=True)


class JudgeReward:
    """The Judge role on `ranks` and the template and parse rule of `cfg` (--reward.judge*)."""

    def __init__(self, cluster, cfg: RewardConfig, ranks=None):
        self.cfg = cfg
        self.template = load_template(cfg.judge_template) if cfg.judge_template else None
        judge_cfg = JudgeConfig(model_path=str(judge_model_dir(cfg)), max_tokens=cfg.judge_max_tokens,
                                free_weights_when_asleep=cfg.judge_free_weights)
        self.group = cluster.spawn(Judge, judge_cfg, ranks=ranks)

    def prompts(self, batch: Batch, tokenizer) -> list[str]:
        """The judge's prompt for every row of a rollout Batch."""
        references = batch["ground_truth"] if "ground_truth" in batch else [None] * len(batch)
        rendered = []
        for prompt, response, reference in zip(judged_prompt_texts(batch, tokenizer), response_texts(batch, tokenizer),
                                               references):
            template = self.template or default_template(self.cfg.judge_parse, self.cfg.judge_score_range,
                                                         with_reference=reference not in (None, ""))
            rendered.append(render(template, prompt, response, reference))
        return rendered

    def request(self, batch: Batch, tokenizer):
        """Send every row's judge prompt to the judge; returns the pending call."""
        return self.group.verdicts.future(Batch({"judge_prompt": self.prompts(batch, tokenizer)}))

    def result(self, pending) -> tuple[torch.Tensor, list[str | None], dict]:
        """The scores of a request's verdicts (unparsable: 0), per row None or why it is not
        scored, and the metrics."""
        judged = pending.result()
        scores, failures = self.scored(judged["verdict"])
        return scores, failures, self.metrics(judged, scores, failures)

    def scored(self, verdicts: list[str]) -> tuple[torch.Tensor, list[str | None]]:
        """Each verdict's score by the parse rule (unparsable: 0), and per verdict None or why unparsable."""
        rule, score_range = self.cfg.judge_parse, self.cfg.judge_score_range
        parsed = [parse_verdict(v, rule, score_range) for v in verdicts]
        failures = [None if p is not None else f"the judge's verdict {v[-200:]!r} states no score by the {rule} rule"
                    for p, v in zip(parsed, verdicts)]
        return torch.tensor([0.0 if p is None else p for p in parsed], dtype=torch.float32), failures

    @staticmethod
    def metrics(judged: Batch, scores: torch.Tensor, failures: list[str | None]) -> dict:
        seconds = judged.meta["judge_s"]   # one per rank when they differ: the slowest sets the pace
        slowest = max(seconds) if isinstance(seconds, list) else seconds
        unparsable = sum(f is not None for f in failures)
        return {"reward/judge_mean": scores.mean().item(),
                "reward/judge_unparsable": unparsable / max(len(failures), 1),
                "reward/judge_unparsable_count": float(unparsable),
                "reward/judge_verdicts_per_s": len(judged) / slowest,
                "reward/judge_tokens_per_s": judged["verdict_tokens"].sum().item() / slowest,
                "reward/judge_prompt_tokens": judged["prompt_tokens"].float().mean().item()}

    def close(self) -> None:
        self.group.close()
