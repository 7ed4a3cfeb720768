"""The embedded default policy: the base model supervised on the arithmetic task until its
greedy held-out accuracy reaches 0.5 (RL gets almost no signal from a policy that is never
right). Built once and cached, like the model itself.
"""
from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

from transformers import AutoTokenizer

from hflow import checkpoint
from hflow.runtime import stopping
from hflow.algos import nll_loss
from hflow.data import DataConfig, PromptSampler, load_prompts
from hflow.default.cache import build_once
from hflow.default.model import default_model_dir
from hflow.recipe_kit.evaluation import evaluate
from hflow.metrics import progress
from hflow.rewards import RewardConfig, Scorer
from hflow.recipe_kit.text_batches import supervised_batch
from hflow.workers import Actor, ActorConfig, RolloutConfig


# Bump whenever anything changes what the warm-up produces (its settings below, or code that changes
# its numbers): the cached policy's directory carries it, so an old cache is not silently reused.
WARM_UP_VERSION = 2


def default_policy_dir(size: str = "default", seed: int = 0, stop_at: float = 0.5, cache_dir=None) -> Path:
    """Where `default_policy` caches the warmed-up embedded default (the base model is built here
    if it is not cached yet; the warm-up is not run)."""
    base = default_model_dir(size, seed, cache_dir)
    return base.with_name(f"{base.name}-sft{stop_at:g}-w{WARM_UP_VERSION}")


def default_policy(cluster, size: str = "default", seed: int = 0, stop_at: float = 0.5,
                   max_steps: int = 1500, cache_dir=None) -> Path:
    """The embedded default policy: hflow's own small Qwen2 model, supervised on the built-in
    arithmetic task until its greedy held-out accuracy reaches `stop_at` (RL gets almost no
    signal from a policy that is never right). Built once and cached, like the model itself.

    No gradient clipping: clipped at norm 1 (the RL default) the loss sits on a plateau near
    10 % accuracy for ~800 steps; unclipped it leaves it after ~400 (500 steps in all to 0.5)."""
    base = default_model_dir(size, seed, cache_dir)

    def warm_up(out: Path) -> None:
        tokenizer = AutoTokenizer.from_pretrained(base)
        data = DataConfig(task="arithmetic", task_seed=seed)
        train, val = load_prompts(data, tokenizer, "train"), load_prompts(data, tokenizer, "val")
        optim = dataclasses.replace(ActorConfig().optim, lr=1e-3, warmup_steps=100, grad_clip=0.0)
        actor = cluster.spawn(Actor, ActorConfig(model_path=str(base), optim=optim, micro_batch_size=128))
        print(f"warming up the embedded default model ({base.name}) until held-out accuracy {stop_at}, "
              f"supervised: RL learns next to nothing from a policy that is never right (once, typically "
              f"500-650 steps, a few minutes; cached in {final})", flush=True)
        rule = Scorer(RewardConfig(fn="arithmetic"))
        # supervised on prompt -> answer, checked every 25 steps on 200 held-out prompts (greedy)
        sampler = PromptSampler(train, 128, shuffle=True, seed=seed)
        rollout = RolloutConfig(n=1, temperature=1.0, max_tokens=5, progress=False)
        reward, first = float("nan"), 1
        # a warm-up stopped by Ctrl-C (runtime/stopping.py) saved its last step: continue it, bit for bit
        if (state := checkpoint.resume_run(partial, {"actor": actor})) is not None:
            sampler.load_state_dict(state["data"])
            reward, first = state["reward"], state["step"] + 1
            print(f"continuing the interrupted warm-up from sft step {state['step']} ({partial})", flush=True)
        # no total: the warm-up ends when the accuracy is reached, not at max_steps (its bound)
        bar = progress(desc=f"sft (to held-out accuracy {stop_at})", unit="step")
        bar.update(first - 1)
        for step in range(first, max_steps + 1):
            metrics = actor.update(supervised_batch(next(sampler), tokenizer), nll_loss)[0]
            bar.update(1)
            if step % 25 == 0 or step == max_steps:
                reward = evaluate(actor, val, tokenizer, rule, rollout, 200, sampled=False).get("eval/reward_mean", reward)
                print(f"sft step {step}: loss {metrics['actor/loss']:.4f}, held-out greedy reward {reward:.3f}")
                bar.set_postfix_str(f"held-out {reward:.3f} of {stop_at}")
                if reward >= stop_at:
                    break
            if (signum := stopping.requested()) is not None:
                bar.close()
                checkpoint.save_run(partial, step, {"actor": actor},
                                    {"data": sampler.state_dict(), "reward": reward}, keep_last=1)
                raise stopping.RunInterrupted(
                    f"hflow: stopped by {stopping.signal_name(signum)} during the warm-up of the embedded "
                    f"default, after sft step {step}, saved in {partial}; the same command continues it", signum)
        bar.close()
        rule.close()
        if reward < stop_at:
            actor.close()
            raise RuntimeError(f"the warm-up reached held-out accuracy {reward:.3f} < {stop_at} in {max_steps} steps")
        actor.export_hf(str(out), str(base))
        actor.close()   # the recipe spawns its own workers on the warmed-up policy

    final = default_policy_dir(size, seed, stop_at, cache_dir)
    partial = final.with_name(final.name + ".partial")
    built = build_once(final, warm_up)
    shutil.rmtree(partial, ignore_errors=True)
    return built
