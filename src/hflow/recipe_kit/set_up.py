"""One set-up for every RL recipe, and the few steps every recipe takes the same way.

    sets = [["actor", "ref"], ["critic", *reward_roles(cfg.reward)]]   # the recipe's split
    setup = set_up(cluster, cfg, sets, algo="ppo", default=EMBEDDED)    # every input checked, then the warm-up
    actor = cluster.spawn(Actor, setup.actor_cfg, ranks=setup.placement["actor"])
    rewards = Rewards(cluster, cfg.reward, setup.tokenizer, setup.reward_model, setup.placement.get("reward"))
    run = setup.run(actor, rewards, trained={"actor": actor})
    old = setup.old_log_probs(kl_in_reward=True)
    for step in run.steps():
        batch = actor.generate(prompt_batch(next(setup.sampler)), rollout)
        ...                                                  # the algorithm
        batch = gather(batch, [*old.pending(actor, batch, temperature), ...])
        kl, metrics["kl/mean"] = kl_to_reference(batch)
        run.end_step(step, metrics | step_metrics(batch, timer.pop()))

A recipe without an embedded default passes `default=None` and needs --model.path. `default`
is any object with the three methods of `EmbeddedDefault` (hflow.default): `base_model(model)`
(the untrained model, whose tokenizer the run uses), `policy(cluster, model)` (what RL starts
from) and `judge(cluster, kind, model)` (its reward or cost model); the library never imports
hflow.default itself.
"""
from __future__ import annotations

import dataclasses
import functools
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoTokenizer

from hflow import algos
from hflow.recipe_kit.async_rollouts import ROLE as ROLLOUT_ROLE, AsyncRollouts, rollout_sets
from hflow.batch import Batch
from hflow.data import ContextRoom, PromptDataset, PromptSampler, load_prompts
from hflow.data.tasks import task_reward_fn
from hflow.engine import SUPPORTED_MODEL_TYPES, stop_token_ids
from hflow.engine.models import runs_fast
from hflow.engine.models.transformers_fallback import why_not_runnable
from hflow.recipe_kit.evaluation import evaluate
from hflow.placement import Placement, job_of, resolve
from hflow.pretrained import resolve_model
from hflow.recipe_kit.run import Run
from hflow.recipe_kit.judging import judge_flag_problems
from hflow.recipe_kit.scoring import check_same_tokenizer
from hflow.validation import ConfigError, read_json_object
from hflow.workers import check_batch_sizes, is_on_policy, rollout_log_probs_exact
from hflow.workers.fsdp import FSDPConfig, resolve_param_dtype
from hflow.workers.rollout import Rollout

# the roles trained by a config group other than --actor.*
CRITIC_ROLES = ("critic", "cost_critic")


@dataclass
class Setup:
    """A run's inputs, checked: the policy (warmed up when it is the embedded default), its
    tokenizer, the prompts, the placement, the data sampler, the reward model's directory."""
    cfg: Any
    model_dir: str
    tokenizer: Any
    train: PromptDataset
    val: PromptDataset | None
    placement: Placement
    sampler: PromptSampler
    reward_model: str | None
    device_type: str
    default: Any = None

    @property
    def actor_cfg(self):
        """--actor.* on the policy: what the Actor and the Reference are spawned with."""
        return dataclasses.replace(self.cfg.actor, model_path=self.model_dir)

    def run(self, actor, rewards, trained: dict, state: dict | None = None, evaluate_fn=None, notes: str = "") -> Run:
        """The run's bookkeeping (hflow.recipe_kit.run.Run): `trained` and the data position (beside
        `state`) in every checkpoint; held-out evaluation of `actor` (greedy and sampled,
        scored by `rewards.rule`) unless `evaluate_fn` replaces it; a few of `rewards`' latest
        samples shown every --trainer.logging.samples-every steps; the final export of `actor`.
        `notes`: what the recipe adds to the run's first line (a critic warm-up, a constraint)."""
        cfg = self.cfg
        evaluate_fn = evaluate_fn or functools.partial(evaluate, actor, self.val, self.tokenizer, rewards.rule,
                                                       cfg.rollout, cfg.trainer.eval_size)
        placement = ", ".join(f"{role} {ranks}" for role, ranks in self.placement.items())
        about = (f"{len(self.train)} training prompts, {cfg.data.batch_size} x {cfg.rollout.n} samples a step; "
                 f"policy {self.model_dir}; placement: {placement}" + (f"; {notes}" if notes else ""))
        return Run(cfg.trainer, trained=trained, state={"data": self.sampler, **(state or {})},
                   evaluate=evaluate_fn, export=(actor, self.model_dir), about=about,
                   samples=lambda: rewards.samples, eval_prompts=len(self.val) if self.val is not None else 0,
                   run_config=dataclasses.asdict(cfg))

    def scorer_dir(self, cluster, value: str, kind: str, flag: str) -> str | None:
        """The directory a --reward.model / --cost.model value names: `default` is the embedded
        default's judge (trained once, cached); a directory must share the policy's tokenizer."""
        if not value:
            return None
        if value == "default":
            return str(self.default.judge(cluster, kind, self.cfg.model))
        check_same_tokenizer(value, self.tokenizer, flag)
        return value

    def rollouts(self, cluster, actor) -> AsyncRollouts | None:
        """The rollout group and the pipeline that feeds it (hflow.recipe_kit.async_rollouts) when the
        placement has one; None when the actor generates."""
        if ROLLOUT_ROLE not in self.placement:
            return None
        trainer = self.cfg.trainer
        group = cluster.spawn(Rollout, self.actor_cfg, self.cfg.rollout, trainer.partial_rollouts,
                              ranks=self.placement[ROLLOUT_ROLE])
        # a checkpoint at the last step carries the next steps' samples, so that a raised --trainer.steps
        # goes on as one longer run would; otherwise nothing is generated past the last step
        saved_at_end = trainer.save_every and trainer.steps % trainer.save_every == 0
        return AsyncRollouts(group, actor, self.sampler, self.cfg.rollout, trainer.async_steps,
                             None if saved_at_end else trainer.steps, partial=trainer.partial_rollouts)

    def old_log_probs(self, kl_in_reward: bool) -> "OldLogProbs":
        """Where this run's old log-probs come from (see OldLogProbs)."""
        return OldLogProbs.choose(self.cfg, self.device_type, kl_in_reward)


def set_up(cluster, cfg, sets: list[list[str]], *, algo: str, default=None, warm_up: bool = True,
           asynchronous: bool = False) -> Setup:
    """Check every input before any work (the policy directory, the scorers, the prompts, the
    placement of `sets`, the batch sizes against it), then warm up the embedded default policy
    (once, cached) unless `warm_up` is False, and train the default reward model if the run
    asks for one. `algo` names the dataflow for --trainer.placement auto. A recipe that runs
    hflow.recipe_kit.async_rollouts says so with `asynchronous`: its placement may then hold a rollout group."""
    model = cfg.model
    async_steps = getattr(cfg.trainer, "async_steps", 0)
    sets = rollout_sets(sets, cfg.trainer.placement, async_steps)
    if getattr(cfg.trainer, "partial_rollouts", False):
        if async_steps < 1:
            raise ConfigError("--trainer.partial-rollouts continues a running generation on weights pushed while "
                              "it runs: it needs --trainer.async-steps 1 or more")
        if cfg.rollout.tp_size > 1:
            raise ConfigError("--trainer.partial-rollouts with --rollout.tp-size > 1 is not supported (the "
                              "tensor-parallel ranks would have to agree on the step the weights change at)")
    if not asynchronous and ["rollout"] in sets:
        raise ConfigError("--trainer.async-steps / a rollout set in --trainer.placement: this recipe generates on "
                          "the actor's ranks only (asynchronous RL: recipes/grpo.py, recipes/ppo.py, recipes/agent.py)")
    if not cfg.trainer.logging.progress_bars:   # one switch for every bar: the phases' and the engine's
        os.environ["HFLOW_PROGRESS"] = "0"
        cfg.rollout.progress = False
    found = scorer_flag_problems(cfg.reward.model, "--reward.model", "reward", model, default) + \
        judge_flag_problems(cfg.reward, cfg.trainer.placement)
    if found:
        raise ConfigError("\n".join(found))
    base = base_policy(model, default)
    model_type = AutoConfig.from_pretrained(base).model_type
    if cfg.rollout.tp_size > 1 and not runs_fast(model_type):
        raise ConfigError(f"--rollout.tp-size {cfg.rollout.tp_size}: model_type {model_type!r} generates on "
                          "transformers' own model in the engine, which has no tensor parallelism; use "
                          f"--rollout.tp-size 1 (the engine's own classes: {', '.join(SUPPORTED_MODEL_TYPES)})")
    if cfg.data.chat and not model.path:
        print("hflow: warning: --data.chat wraps every prompt in the chat template, which the embedded default "
              "model has never seen (it was warmed up on bare '27+82=' prompts): expect rewards near 0; drop "
              "--data.chat, or give a chat model with --model.path", flush=True)
    if not cfg.reward.fn and not cfg.reward.model and not cfg.reward.judge and not cfg.data.train_files:
        cfg.reward.fn = task_reward_fn(cfg.data.task)   # an empty --reward.fn is the built-in task's own checker
    tokenizer = AutoTokenizer.from_pretrained(base)
    resolve_compute_dtypes(cfg, base, cluster.device_type)   # before anything reads them (old log-probs)
    warn_if_responses_cannot_stop(base)
    room = context_room(base, cfg.rollout)
    train, val = (load_prompts(cfg.data, tokenizer, split, room) for split in ("train", "val"))
    # after the model and prompts: --trainer.placement auto plans from their shapes
    # what --trainer.placement auto prices: an old log-probs pass of the actor if any is recomputed
    recomputed = OldLogProbs.choose(cfg, cluster.device_type, kl_in_reward=True).source == "recompute"
    placement = resolve(cfg.trainer.placement, sets, cluster.world_size, algo=algo, device_type=cluster.device_type,
                        job=job_of(cfg, str(base), train, recomputed))
    check_batch_sizes(cfg.data.batch_size, cfg.rollout.n, cfg.actor.mini_batch_size, len(placement["actor"]), "actor")
    for role in CRITIC_ROLES:
        if role in placement:
            check_batch_sizes(cfg.data.batch_size, cfg.rollout.n, cfg.critic.mini_batch_size, len(placement[role]),
                              "critic")
    policy = default.policy(cluster, model) if not model.path and warm_up else base
    setup = Setup(cfg, str(policy), tokenizer, train, val, placement,
                  PromptSampler(train, cfg.data.batch_size, cfg.data.shuffle, cfg.data.seed), None,
                  cluster.device_type, default)
    return dataclasses.replace(setup, reward_model=setup.scorer_dir(cluster, cfg.reward.model, "reward", "--reward.model"))


def resolve_compute_dtypes(cfg, base: Path, device_type: str) -> None:
    """Make every trained or frozen model's `--<role>.fsdp.param-dtype auto` concrete for the
    policy's size on this machine (hflow.workers.fsdp.auto_param_dtype), in place."""
    hidden = AutoConfig.from_pretrained(base).hidden_size
    for name, part in vars(cfg).items():
        if isinstance(getattr(part, "fsdp", None), FSDPConfig):
            part.fsdp = resolve_param_dtype(part.fsdp, torch.device(device_type), hidden,
                                            f"--{name.replace('_', '-')}.fsdp.param-dtype")


def base_policy(model, default=None) -> Path:
    """--model.path (a directory, a .gguf file, a Hub id or a fetched name: hflow.pretrained,
    resolved to a Hugging Face directory), or the embedded default's untrained model
    (`default.base_model`), checked: a model the engine and the workers support."""
    if not model.path and default is None:
        raise ConfigError("--model.path is required: this recipe has no embedded default model")
    path = resolve_model(model.path, "--model.path") if model.path else default.base_model(model)
    check_policy_dir(path)
    return path


def check_policy_dir(path) -> None:
    """A Hugging Face directory of a model the engine and the workers support, or an error
    that says what to change."""
    config = Path(path) / "config.json"
    if not config.exists():
        raise ConfigError(f"--model.path {path}: not a Hugging Face model directory (no config.json)")
    model_type = read_json_object(config, f"--model.path {path}").get("model_type")
    refusal = why_not_runnable(model_type)
    if refusal is not None:
        raise ConfigError(f"--model.path {path}: model_type {model_type!r} is not supported: {refusal}")


def context_room(path, rollout) -> ContextRoom:
    """How long a prompt may be so that it and a response of --rollout.max-tokens fit the
    engine's context (--rollout.max-model-len, else the model's max_position_embeddings)."""
    context = rollout.max_model_len or max_position_embeddings(path)
    room = ContextRoom(context - rollout.max_tokens, f"the model's context of {context} tokens less "
                                                     f"--rollout.max-tokens {rollout.max_tokens}")
    if room.tokens < 1:
        raise ConfigError(f"--rollout.max-tokens {rollout.max_tokens} leaves no room for a prompt in the model's "
                          f"context of {context} tokens (--rollout.max-model-len, else max_position_embeddings)")
    return room


def max_position_embeddings(path) -> int:
    """The model's context, from its config.json."""
    config = Path(path) / "config.json"
    context = read_json_object(config, f"--model.path {path}").get("max_position_embeddings")
    if isinstance(context, int) and not isinstance(context, bool) and context > 0:
        return context
    what = "has no max_position_embeddings" if context is None else \
        f"has max_position_embeddings {context!r}, not a positive integer"
    raise ConfigError(f"--model.path {path}: {config} {what}; give the model's context with --rollout.max-model-len")


def warn_if_responses_cannot_stop(path) -> None:
    """A model directory without an EOS id: every response runs to --rollout.max-tokens, which
    quietly ruins a task whose answers must end (the default's accuracy 0.53 -> 0.13)."""
    if not stop_token_ids(path):
        print(f"hflow: warning: {path} names no end-of-sequence token (no eos_token_id in generation_config.json "
              f"or config.json), so every response runs to --rollout.max-tokens; set eos_token_id there to the "
              f"token that ends an answer", flush=True)


def scorer_flag_problems(value: str, flag: str, kind: str, model, default) -> list[str]:
    """What is wrong with a --reward.model / --cost.model value, before any work: `default` is
    the embedded default policy's own judge, so it needs that policy; anything else but empty
    must be a Hugging Face directory."""
    if value == "default" and (model.path or default is None):
        return [f"{flag} default is the embedded default policy's {kind} model; with --model.path give a {kind} "
                f"model trained for that policy's tokenizer (recipes/reward_model.py{' --cost' * (kind == 'cost')})"]
    if value and value != "default" and not (Path(value) / "config.json").exists():
        return [f"{flag} {value}: not a Hugging Face model directory (no config.json)"]
    return []


class OldLogProbs:
    """Where a step's old log-probs come from: the sampling policy's log-probs of its own tokens,
    which a KL in the reward, an off-policy update (several epochs or mini-batches) and the
    rollout correction need; and the correction itself (`correction`, for the actor's loss).

    update     on-policy without a KL in the reward: the update's own detached log-probs are
               the old ones (ratio exactly 1), so no pass is spent on them;
    rollout    the engine's sampled-token log-probs (--algo.old-log-probs rollout, or auto when
               the actor computes in fp32, where they equal a recomputation to ~1e-6, the run is
               synchronous and no correction is on: it would compare the engine's with
               themselves);
    recompute  a forward pass of the actor (--algo.old-log-probs recompute, or auto in bf16,
               where the engine's differ).

    Asynchronous (--trainer.async-steps above 0), the engine's log-probs are a stale policy's:
    auto recomputes (or takes the update's own on-policy), and --algo.rollout-correction auto is
    tis, which weighs each token by the capped ratio of the trainer's policy to the engine's —
    AReaL's decoupled objective, the clip against the trainer's policy. An explicit
    --algo.old-log-probs rollout with no correction clips against the stale policy instead."""

    def __init__(self, source: str, correction: algos.RolloutCorrection | None = None):
        self.source = source
        self.correction = correction or algos.RolloutCorrection(measured=source != "rollout")

    @classmethod
    def choose(cls, cfg, device_type: str, kl_in_reward: bool) -> "OldLogProbs":
        """For a recipe's Config: its --actor.* and --data.batch-size, and --algo.old-log-probs
        and --algo.rollout-correction* (hflow.recipe_kit.config.OffPolicyConfig; auto and none when the
        recipe has no such flags)."""
        algo = getattr(cfg, "algo", None)
        choice = getattr(algo, "old_log_probs", "auto")
        stale = getattr(getattr(cfg, "trainer", None), "async_steps", 0) > 0
        exact = rollout_log_probs_exact(cfg.actor, device_type) and not stale
        mode = getattr(algo, "rollout_correction", "none")
        mode = ("none" if exact else "tis") if mode == "auto" else mode
        if mode != "none" and choice == "rollout":
            raise ConfigError(f"--algo.rollout-correction {mode} weighs the engine's log-probs against the trainer's; "
                              f"with --algo.old-log-probs rollout the trainer's are the engine's: use recompute or auto")
        if is_on_policy(cfg.actor, cfg.data.batch_size) and not kl_in_reward:
            source = "update"
        else:
            source = "rollout" if choice == "rollout" or (choice == "auto" and exact and mode == "none") else "recompute"
        correction = algos.RolloutCorrection(mode, getattr(algo, "rollout_correction_level", "token"),
                                             getattr(algo, "rollout_correction_cap", 2.0), measured=source != "rollout")
        return cls(source, correction)

    def pending(self, actor, batch: Batch, temperature: float) -> list:
        """What this step's old log-probs need started: the engine's are put in `batch` now (no
        call); a recomputation is the actor's future, to merge with the other parts."""
        if self.source == "rollout":
            batch["old_log_probs"] = batch["rollout_log_probs"]
        return [actor.log_probs.future(batch, temperature)] if self.source == "recompute" else []


def gather(batch: Batch, pending: list) -> Batch:
    """`batch` with the columns of every pending call's result (log-probs, values) added, in
    the order given; the calls ran at the same time where their groups sit on different ranks."""
    for part in pending:
        batch = batch | part.result()
    return batch


def kl_to_reference(batch: Batch) -> tuple[torch.Tensor, float]:
    """k1 per token of the sampling policy to the reference, log pi_old - log pi_ref (0 outside
    response_mask; the old log-probs, or on-policy the engine's), and its mean (kl/mean)."""
    mask = batch["response_mask"]
    sampled = batch["old_log_probs"] if "old_log_probs" in batch else batch["rollout_log_probs"]
    kl = algos.kl_penalty(sampled, batch["ref_log_probs"], "k1") * mask
    return kl, algos.masked_mean(kl, mask).item()


def step_metrics(batch: Batch, times: dict[str, float]) -> dict[str, float]:
    """What every step logs besides its algorithm's figures: the phases' times, and for a
    non-empty batch the response lengths, the share that stopped before --rollout.max-tokens and
    tokens/s of the whole step."""
    if not len(batch):
        return dict(times)
    lengths = batch["response_mask"].sum(1)
    # a single-turn response that ended on a stop token, or a trajectory its environment ended
    stopped = [reason in ("stop", "done") for reason in batch["finish_reason"]]
    return {"response_length/mean": lengths.mean().item(), "response_length/max": lengths.max().item(),
            "response/stop_fraction": sum(stopped) / max(len(stopped), 1), **times,
            "throughput/tokens_per_s": lengths.sum().item() / times["time/step_s"]}
