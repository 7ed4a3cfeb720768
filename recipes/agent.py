"""GRPO over multi-turn trajectories with tools: the model calls tools, reads their results, answers.

    torchrun --nproc-per-node 2 recipes/agent.py                    # the embedded default, 3-digit products, calculator
    torchrun --nproc-per-node 2 recipes/agent.py --agent.env no_tools   # the same policy with the tool switched off
    torchrun --nproc-per-node 2 recipes/agent.py --agent.env my_envs.py:Search --agent.reward env
    python examples/tool_prompts.py --out data/multiply_tool   # the task with one worked calculator exchange
    torchrun --nproc-per-node 2 recipes/agent.py --model.path smollm2-135m-instruct \
        --data.train-files data/multiply_tool/train.jsonl --data.val-files data/multiply_tool/val.jsonl \
        --reward.fn gsm8k_flexible --rollout.max-tokens 64 --agent.max-turns 3   # a real model, on a CPU
    torchrun --nproc-per-node 8 recipes/agent.py --model.path ~/models/Qwen3-0.6B \
        --data.train-files gsm8k/train.parquet --data.val-files gsm8k/test.parquet --data.chat \
        --agent.env calculator_hermes --reward.fn gsm8k --rollout.max-tokens 1024 --agent.max-turns 6
    torchrun ... recipes/agent.py --help                            # every flag, grouped

Each step: run `rollout.n` trajectories for each of `data.batch-size` prompts on the actor's
engine (hflow.agents: every trajectory in flight at once, tools on threads while the engine
decodes the others). A trajectory is one token stream: the prompt, the model's turns as sampled,
and between them each tool result (observation), which the model reads but is never trained on
(response_mask 0). `--rollout.max-tokens` is the whole trajectory's budget after the prompt,
model and observation tokens together; `--agent.*` bounds turns, observations and tool time.

The score of a trajectory (`--agent.reward`): env, the environment's own reward (its turns'
rewards summed; 0 for a failed trajectory); fn, `--reward.fn` (and/or `--reward.model`) on all
the model's text, observations left out; sum, both. The built-in environments (calculator:
`<calc>27*82</calc>` -> `<result>2214</result>`; calculator_hermes: Qwen's `<tool_call>` JSON;
no_tools: no tool at all) score the final answer, the turn without a call, by `--reward.fn`
(arithmetic when unset). Whichever the score, it is kept as grpo.py's (hflow.recipe_kit.scoring.Rewards): a few
trajectories with their scores in <output_dir>/samples.jsonl, the run stopped once every trajectory
failed `--reward.max-failed-batches` batches in a row (env: a tool or environment error, or the
reward function failing on the final answer), a warning when the first batches all scored alike.

The embedded default's task (`--data.task multiply`, "127*46=" -> "5842") is one the model cannot
do in its head; its starting policy is the warm-up taught to call the calculator and then, mostly,
to answer directly (hflow/default/tool_use.py): it calls the tool on a few sampled problems in a
hundred and never greedily, so RL has calls to find and must learn that they get products right.

A real model's template carries the calculator as it is: the call is text in an assistant turn,
the result a `tool` message; a prompt given as chat messages is rendered once, through the
template. SmolLM2-135M-Instruct told of the tool in a system prompt (`--data.system-prompt`)
calls it in a few samples in a hundred, never to good effect, and RL gets no reward to learn from;
shown one worked exchange in the prompt (examples/tool_prompts.py) its few calls are right, and
RL makes it call on every problem within 5-10 steps (docs/real-model.md). With --model.path the
learning rate, the temperature and the micro-batch budget default to grpo.py's real-model values.

The advantages are grpo.py's (`--algo.estimator grpo|drgrpo|rloo|reinforce_pp|reinforce_pp_baseline`,
their formulas in recipes/grpo.py) over the n trajectories of a prompt, the loss its
`--algo.loss ppo|gspo|cispo|sapo` on the model's tokens only, with an optional KL to the reference.
Held-out evaluation runs the trajectories too, greedily: eval/reward_mean is the mean score as
`--agent.reward` defines it, eval/agent/* the trajectories' figures.

Credit (`--agent.credit`): trajectory (the default) sums an environment's per-turn rewards into
the trajectory's score, placed on its last model token, and the estimator compares the prompt's
n trajectories. turn gives each turn's tokens their own credit (hflow.algos.turn_advantages):
turn t's discounted return-to-go G_t = sum_{t' >= t} gamma^(t'-t) r_t' (`--agent.turn-discount`
gamma; 1: every later turn's reward, 0: its own alone), against the prompt's trajectories at
the same turn (GiGPO's step-wise group, the turn index standing for its anchor state), plus
`--agent.episode-weight` times the trajectory's own group advantage (GiGPO's omega is its
inverse, up to scale; 0: per-turn alone). It needs `--agent.reward env` and `--algo.estimator
grpo` (divided by the group's std) or drgrpo (not), the KL in the loss. `--agent.env
multi_question --data.task arithmetic` is a task for it: three problems in a row, each answer
rewarded on its own (hflow/agents/multi_question.py; docs/agents.md has what each credit learns).

An agent you already have, written against the official openai client, trains as it is:
`--agent.env path/file.py:solve` names a function `solve(row, base_url) -> reward`. Each actor
rank then serves its engine on loopback during the rollout (an OpenAI-compatible endpoint,
hflow.agents.endpoint) and calls `solve` once per trajectory with the base_url of a session of
its own; every request through it is one turn, recorded token for token as an environment's
trajectory is (examples/openai_calculator.py; docs/agents.md says what is recorded and the rule
for a client that edits its history).

Supports: any environment `module:Class` / `path/file.py:Class` (reset(row), step(text)),
chat-template models (tool results as the template's own delta) and plain-text ones, the
estimators and losses above, several PPO epochs and mini-batches, checkpoints and resume,
colocated or split placement; an environment's per-turn rewards, summed onto its trajectory or
credited turn by turn; a tensor-parallel engine (`--rollout.tp-size`: the tp group's first rank
runs the group's sessions, the others replay its engine steps, hflow/workers/lockstep_engine.py);
asynchronous steps (`--trainer.async-steps k`, `--trainer.partial-rollouts`: a rollout group on
ranks of its own runs the next k steps' trajectories, each model turn's policy version recorded:
async/turn_staleness_*). Not (yet): DAPO's dynamic sampling and overlong shaping.
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field
from typing import Literal, Optional

import torch

import hflow
from hflow import algos
from hflow.agents import BUILTIN_ENVIRONMENTS, AgentLimits, agent_rollout_metrics, environment_factory, environment_failures
from hflow.recipe_kit.config import (ActorConfig, DataConfig, ModelConfig, OptimConfig, RewardConfig, RolloutConfig,
                          TrainerConfig, by_model)
from hflow.recipe_kit.critic_free import CriticFreeConfig, critic_free_loss, resolve_critic_free
from hflow.default import EMBEDDED, tool_calling_policy
from hflow.metrics import Timer
from hflow.recipe_kit.evaluation import evaluate
from hflow.recipe_kit.set_up import gather, kl_to_reference, set_up, step_metrics
from hflow.recipe_kit.scoring import Rewards, reward_roles, score
from hflow.recipe_kit.text_batches import agent_prompt_batch
from hflow.validation import ConfigError
from hflow.workers import Actor, Reference


@dataclass
class AgentConfig:
    env: str = "calculator"
    """The environment: a built-in (calculator, calculator_hermes, no_tools, multi_question), a library's (textarena:GAME, gym:ENV), 'package.module:Class' or 'path/to/file.py:Class' (a class with reset(row) and step(text), e.g. a subclass of hflow.agents.Environment), or an agent function 'path/to/file.py:solve' (solve(row, base_url) -> reward, written with the openai client; hflow serves it the engine)."""
    reward: Literal["env", "fn", "sum"] = "env"
    """A trajectory's score: env (the environment's reward; the built-ins score the final answer by --reward.fn), fn (--reward.fn / --reward.model on all the model's text, observations left out), or sum (both)."""
    max_turns: int = AgentLimits.max_turns
    """Model turns per trajectory; one still going after this many ends as max_turns."""
    max_turn_tokens: Optional[int] = AgentLimits.max_turn_tokens
    """A cap on one model turn (None: only the trajectory's budget, --rollout.max-tokens)."""
    max_observation_tokens: int = AgentLimits.max_observation_tokens
    """The most tokens of one observation's content; longer content is cut and marked."""
    tool_timeout_s: float = AgentLimits.tool_timeout_s
    """One tool call; a call still running after this is killed and ends its trajectory as tool_timeout."""
    step_timeout_s: float = AgentLimits.step_timeout_s
    """One environment step, its tool calls included; past it the trajectory ends as env_timeout."""
    credit: Literal["trajectory", "turn"] = "trajectory"
    """How rewards become advantages: trajectory (the turns' rewards summed on the last model token, then --algo.estimator over the prompt's trajectories) or turn (each turn's return-to-go on its own tokens, against the prompt's trajectories at the same turn; needs --agent.reward env)."""
    turn_discount: float = 1.0
    """gamma over turns with --agent.credit turn: turn t is credited with sum_{t'>=t} gamma^(t'-t) r_t' (1: every later turn's reward; 0: its own alone)."""
    episode_weight: float = 0.0
    """With --agent.credit turn: the weight of the trajectory's own group advantage, added to every turn's (0: per-turn credit alone; GiGPO's omega = 1 is 1)."""


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=lambda: DataConfig(task="multiply"))
    reward: RewardConfig = field(default_factory=RewardConfig)
    agent: AgentConfig = field(default_factory=AgentConfig)
    # with --model.path: grpo.py's real-model values, which learned here too (SmolLM2-135M-Instruct,
    # the calculator, one worked exchange in the prompt: held-out greedy 0.008 -> 1.0 in 5-10 steps,
    # docs/real-model.md): lr 1e-5, temperature 0.7, micro-batches of 1024 tokens
    actor: ActorConfig = field(default_factory=lambda: ActorConfig(
        optim=OptimConfig(lr=by_model(1e-4, 1e-5)), max_tokens_per_micro_batch=by_model(8192, 1024)))
    rollout: RolloutConfig = field(default_factory=lambda: RolloutConfig(
        n=8, max_tokens=by_model(48, 1024), temperature=by_model(1.0, 0.7)))
    algo: CriticFreeConfig = field(default_factory=CriticFreeConfig)
    trainer: TrainerConfig = field(default_factory=lambda: TrainerConfig(
        steps=60, eval_every=20, output_dir="outputs/agent"))


def check_agent(cfg: Config) -> AgentLimits:
    """The environment found and the limits checked before anything loads (a ConfigError: one
    line, exit status 2); the limits the rollout runs under."""
    spec = cfg.agent.env
    if ":" not in spec and spec not in BUILTIN_ENVIRONMENTS:   # most likely a misspelt built-in
        raise ConfigError(f"--agent.env {spec}: not a built-in environment ({', '.join(BUILTIN_ENVIRONMENTS)}), "
                          "nor 'package.module:Class' or 'path/to/file.py:Class', "
                          "nor a library's environment ('textarena:GAME', 'gym:ENV', 'verifiers:TASKSET')")
    try:
        environment_factory(spec)
    except (ValueError, ImportError, AttributeError) as e:
        raise ConfigError(f"--agent.env {spec}: {str(e).removeprefix(f'environment {spec!r}: ')}") from None
    if cfg.agent.reward == "env" and cfg.reward.model:
        raise ConfigError(f"--reward.model {cfg.reward.model} with --agent.reward env: the reward model would "
                          "score nothing; use --agent.reward fn or sum")
    check_credit(cfg)
    a = cfg.agent
    return AgentLimits(max_turns=a.max_turns, max_response_tokens=cfg.rollout.max_tokens,
                       max_turn_tokens=a.max_turn_tokens, max_observation_tokens=a.max_observation_tokens,
                       tool_timeout_s=a.tool_timeout_s, step_timeout_s=a.step_timeout_s)


def check_credit(cfg: Config) -> None:
    """--agent.credit turn's combinations, refused in one line (ConfigError) before anything loads."""
    a, algo = cfg.agent, cfg.algo
    if not 0.0 <= a.turn_discount <= 1.0:
        raise ConfigError(f"--agent.turn-discount {a.turn_discount}: must be in [0, 1]")
    if a.episode_weight < 0:
        raise ConfigError(f"--agent.episode-weight {a.episode_weight}: must be >= 0")
    if a.credit != "turn":
        return
    if a.reward != "env":
        raise ConfigError(f"--agent.credit turn with --agent.reward {a.reward}: per-turn credit needs the "
                          "environment's per-turn rewards (--agent.reward env)")
    if algo.estimator not in ("grpo", "drgrpo"):
        raise ConfigError(f"--agent.credit turn with --algo.estimator {algo.estimator}: its baselines are grpo's "
                          "(divided by the group's std) or drgrpo's (not)")
    if algo.kl_in_reward and algo.kl_coef > 0:
        raise ConfigError("--agent.credit turn with --algo.kl-in-reward: put the KL in the loss "
                          "(--algo.no-kl-in-reward)")


def turn_credit(batch, groups, cfg: Config) -> torch.Tensor:
    """--agent.credit turn's advantages, [B, R] (0 off the model's tokens): the environment's
    reward per turn (0 for every turn of a failed trajectory) as hflow.algos.turn_advantages says."""
    rewards, valid = algos.pad_turn_rewards(batch["turn_rewards"])
    return algos.turn_advantages(batch["turn_index"], rewards, valid, batch["response_mask"], groups,
                                 gamma=cfg.agent.turn_discount, episode_weight=cfg.agent.episode_weight,
                                 norm_by_std=cfg.algo.estimator == "grpo")


def turn_reward_means(batch) -> dict:
    """reward/turn_<t>: the mean reward of turn t over the trajectories that reached it."""
    rewards, valid = algos.pad_turn_rewards(batch["turn_rewards"])
    reached = valid.sum(0)
    return {f"reward/turn_{t}": (rewards[:, t].sum() / reached[t]).item() for t in range(rewards.shape[1])
            if reached[t] > 0}


def environment(cfg: Config):
    """What the rollout builds its environments from: a built-in scores its final answer by
    --reward.fn (arithmetic when unset); a user's environment is named as given."""
    if cfg.agent.env in BUILTIN_ENVIRONMENTS:
        return functools.partial(BUILTIN_ENVIRONMENTS[cfg.agent.env], reward_fn=cfg.reward.fn or "arithmetic")
    return cfg.agent.env


def environment_fix(cfg: Config) -> str:
    """What to fix when every trajectory's environment reward failed, batch after batch: the
    environment, and for a built-in the --reward.fn that scores its final answer."""
    fix = f"fix --agent.env {cfg.agent.env}"
    if cfg.agent.env in BUILTIN_ENVIRONMENTS:
        fix += f" or --reward.fn {cfg.reward.fn or 'arithmetic'}, which scores its final answer"
    return fix


def trajectory_scores(batch, rewards: Rewards, cfg: Config) -> tuple[torch.Tensor, dict]:
    """One training score per trajectory as --agent.reward says, and the reward/* metrics;
    `rewards` keeps them as it keeps its own (samples.jsonl, the stop, the no-signal warning)."""
    env, source = batch["trajectory_reward"], cfg.agent.reward
    if source == "env":
        rewards.record(batch, env, environment_failures(batch), culprit="the environment", unit="trajectory",
                       fix=environment_fix(cfg))
        return env, {"reward/mean": env.mean().item()}
    text, metrics = rewards(batch)   # response_texts: the model's tokens only, never a tool's output
    if source == "fn":
        return text, metrics
    rewards.samples = rewards.sampled(batch, env + text)   # the samples show the score trained on
    metrics["reward/text_mean"] = metrics.pop("reward/mean")
    return env + text, metrics | {"reward/mean": (env + text).mean().item()}


def held_out_trajectories(actor, tokenizer, rule, cfg: Config, limits: AgentLimits):
    """How held-out evaluation responds (hflow.recipe_kit.evaluation.Respond): one trajectory
    per prompt, scored as --agent.reward defines it (the text by the rule alone). The batch's
    total is its float32 mean score times its rows, as the trajectories' figures (eval/agent/*)
    are weighted: eval/reward_mean to the last digit as this recipe has always logged it."""
    def respond(rows, rollout):
        batch = actor.generate_agent(agent_prompt_batch(rows), environment(cfg), rollout, limits)
        scores = torch.zeros(len(batch))
        if cfg.agent.reward != "fn":
            scores += batch["trajectory_reward"]
        if cfg.agent.reward != "env":
            scores += score(batch, tokenizer, rule)[0]
        return batch, scores.mean().item() * len(batch)
    return respond


def main(cluster: hflow.Cluster, cfg: Config):
    limits = check_agent(cfg)   # a bad --agent.env is refused before any model loads
    algo = resolve_critic_free(cfg.algo)
    # split: the models that only read (reference, reward model) on ranks of their own
    sets = [["actor"], (["ref"] if algo.kl_coef > 0 else []) + reward_roles(cfg.reward)]
    # every input checked, then the warm-up; a rollout group of its own with --trainer.async-steps
    setup = set_up(cluster, cfg, sets, algo="grpo", default=EMBEDDED, asynchronous=True)
    if not cfg.model.path and not cfg.data.train_files and cfg.data.task == "multiply":
        # the embedded default's starting policy calls its calculator now and then (see the docstring)
        setup = dataclasses.replace(setup, model_dir=tool_calling_policy(cluster, setup.model_dir, setup.train,
                                                                         setup.tokenizer))
    placement, env = setup.placement, environment(cfg)
    rewards = Rewards(cluster, cfg.reward, setup.tokenizer, setup.reward_model, placement.get("reward"),
                      judge_ranks=placement.get("judge"))
    actor = cluster.spawn(Actor, setup.actor_cfg, ranks=placement["actor"])
    ref = cluster.spawn(Reference, setup.actor_cfg, ranks=placement["ref"]) if "ref" in placement else None
    rollouts = setup.rollouts(cluster, actor)   # None: the actor's own engine runs the trajectories
    if rollouts:   # a rollout group runs the next steps' trajectories while this one trains
        rollouts.with_agent(env, limits)
    # held-out evaluation runs the tools too, greedily: a single-turn answer would not show what was learned
    evaluate_fn = functools.partial(
        evaluate, actor, setup.val, setup.tokenizer, rewards.rule, cfg.rollout, cfg.trainer.eval_size, sampled=False,
        respond=held_out_trajectories(actor, setup.tokenizer, rewards.rule, cfg, limits),
        batch_figures=functools.partial(agent_rollout_metrics, prefix="eval/agent/"))
    run = setup.run(actor, rewards, trained={"actor": actor}, evaluate_fn=evaluate_fn,
                    state={"rollouts": rollouts} if rollouts else None)
    old = setup.old_log_probs(kl_in_reward=ref is not None and algo.kl_in_reward)
    loss_fn = functools.partial(critic_free_loss, algo=algo, correction=old.correction)
    estimator = algos.estimator(algo.estimator)

    timer, temperature = Timer(), cfg.rollout.temperature
    for step in run.steps():
        with timer("step"):
            with timer("generate"):
                # a seed per step: a resumed run draws the trajectories the uninterrupted one drew
                if rollouts:   # generated ahead, while earlier steps trained; staleness per row and per turn
                    batch, async_metrics = rollouts.take(step)
                else:
                    rollout = cfg.rollout.for_step(step)
                    batch, async_metrics = actor.generate_agent(agent_prompt_batch(next(setup.sampler)), env,
                                                                rollout, limits), {}
            scores, metrics = trajectory_scores(batch, rewards, cfg)
            metrics |= async_metrics
            mask = batch["response_mask"]
            with timer("log_probs"):
                refs = [ref.log_probs.future(batch, temperature)] if ref else []
                batch = gather(batch, refs + old.pending(actor, batch, temperature))
            # the outcome lands on the model's last token: observations between turns earn nothing
            token_rewards = algos.scores_to_token_rewards(scores, mask)
            if ref:   # KL of the sampling policy to the reference, on the model's tokens
                kl, metrics["kl/mean"] = kl_to_reference(batch)
                if algo.kl_in_reward:
                    token_rewards = token_rewards - algo.kl_coef * kl
            # a prompt's n trajectories are each other's baseline: no critic
            groups = torch.arange(len(batch)) // cfg.rollout.n
            if cfg.agent.credit == "turn":   # each turn's rewards on its own tokens, not the score on the last
                batch["advantages"] = turn_credit(batch, groups, cfg)
            else:
                batch["advantages"] = estimator(token_rewards, mask, groups, gamma=algo.gamma)
            if cfg.agent.reward == "env":
                metrics |= turn_reward_means(batch)
            with timer("update"):
                metrics |= actor.update(batch, loss_fn, loss_agg=algo.loss_agg)[0]
            if rollouts:   # the new weights to the rollout group, behind the trajectories already issued
                rollouts.push(step)
        run.end_step(step, metrics | step_metrics(batch, timer.pop()) | agent_rollout_metrics(batch))
    run.finish()
    rewards.close()


if __name__ == "__main__":
    hflow.launch(main, Config)   # rank 0 parses and checks the flags
