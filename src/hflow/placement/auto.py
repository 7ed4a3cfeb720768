"""--trainer.placement auto: the planner (HybridFlow Algorithm 1) over hflow's own layouts, with
the profile of the machine the run is on.

    job = job_of(cfg, model_dir, train, actor_log_probs=False)   # the models and one step's work
    plan = resolve("auto", sets, cluster.world_size, algo="ppo", job=job)

The profile: on CPU, this machine measured (hflow.planner.hardware.cpu_profile: matmul and
memory rates of one rank's threads, gloo between two processes, the cores the ranks share;
~5-20 s); on GPUs, the published profile named by `torch.cuda.get_device_name` (A100, H100,
H200) with the device's memory. Every role is priced with the policy's shape (hflow's critics,
reference and scorers start from it). The log lists each grouping's best allocation with its
predicted seconds a step, fastest first.
"""
from __future__ import annotations

import dataclasses
import os
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from hflow.placement.ranks import Placement
from hflow.planner.asynchronous import ROLLOUT_ROLE, AsyncPlan, async_plans
from hflow.planner.fsdp import FSDPPlanner
from hflow.planner.hardware import PROFILES, GiB, Hardware, cpu_profile
from hflow.planner.models import ModelShape, Workload, dataflow, model_shape
from hflow.planner.search import Plan, kind, ranks_text


@dataclass(frozen=True)
class Job:
    """What `auto` prices: every role's shape (the policy's) and one RL step's work."""
    model: ModelShape
    work: Workload
    generation_tp: int = 1          # --rollout.tp-size
    actor_log_probs: bool = False   # the actor recomputes its old log-probs (else: the engine's)


def job_of(cfg, model_dir: str, prompts, actor_log_probs: bool) -> Job:
    """The Job of a recipe's Config (its data, rollout and actor flags), the policy directory,
    the training prompts (their mean length is the prompt length) and whether the actor
    recomputes the old log-probs (hflow.recipe_kit.set_up.OldLogProbs) instead of taking the engine's."""
    lengths = [len(ids) for ids in prompts.prompt_ids]
    actor, batch = cfg.actor, cfg.data.batch_size
    minibatches = batch // actor.mini_batch_size if actor.mini_batch_size else 1
    prompt_len = max(1, round(statistics.mean(lengths)))
    seq_len = prompt_len + cfg.rollout.max_tokens
    work = Workload(batch, prompt_len, cfg.rollout.max_tokens, cfg.rollout.n, actor.epochs * minibatches,
                    actor.max_tokens_per_micro_batch or actor.micro_batch_size * seq_len)
    return Job(model_shape(str(Path(model_dir) / "config.json")), work, cfg.rollout.tp_size, actor_log_probs)


def machine_profile(device_type: str, world_size: int) -> Hardware:
    """The profile of this machine: measured on CPU, published for a known GPU."""
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    if device_type == "cpu":
        return cpu_profile(per_node)
    import torch

    name = torch.cuda.get_device_name(0)
    profile = next((k for k in PROFILES if k in name.lower()), None)
    if profile is None:
        raise ValueError(f"--trainer.placement auto: no profile for the GPU {name!r} (profiles: "
                         f"{', '.join(PROFILES)}); name a placement instead (colocate, split, standalone or a SPEC)")
    memory = torch.cuda.get_device_properties(0).total_memory
    return dataclasses.replace(PROFILES[profile], devices_per_node=per_node, memory=memory)


def planner_for(sets: list[list[str]], world_size: int, algo: str, job: Job, hw: Hardware) -> FSDPPlanner:
    flow = dataflow(algo, {role: job.model for s in sets for role in s}, require=False,
                    actor_log_probs=job.actor_log_probs)
    return FSDPPlanner(flow, job.work, hw, world_size, job.generation_tp)


def auto_placement(sets: list[list[str]], world_size: int, *, algo: str, job: Job | None,
                   device_type: str | None = None, log: Callable[[str], None] = print) -> Placement:
    if job is None:
        raise ValueError("--trainer.placement auto needs the run's job: resolve(..., job=hflow.placement.job_of("
                         "cfg, model_dir, train_prompts, device_type))")
    if device_type is None:
        import torch
        device_type = "cuda" if torch.cuda.is_available() else "cpu"
    if [ROLLOUT_ROLE] in sets:
        return auto_async_placement(sets, world_size, algo=algo, job=job, device_type=device_type, log=log)
    hw = machine_profile(device_type, world_size)
    try:
        planner = planner_for(sets, world_size, algo, job, hw)
        plans = candidates(planner, sets)
    except ValueError as e:
        raise ValueError(f"--trainer.placement auto: {e}") from None
    for line in describe(plans, planner, sets):
        log(line)
    roles = [role for s in sets for role in s]
    chosen = plans[0].placement()
    return Placement({role: chosen[role] for role in roles})


def auto_async_placement(sets: list[list[str]], world_size: int, *, algo: str, job: Job, device_type: str,
                         log: Callable[[str], None] = print) -> Placement:
    """An asynchronous run's placement: of every split of the ranks into a training group (every
    other role, colocated, on the first ranks) and a rollout group (the rest), the one with the
    fastest overlapped step (hflow.planner.asynchronous), logged beside the other splits."""
    training = [s for s in sets if s != [ROLLOUT_ROLE]]
    if world_size < 2:
        raise ValueError("--trainer.placement auto with a rollout group (--trainer.async-steps >= 1) needs 2 ranks or "
                         "more: one to train, one to generate")
    hw = machine_profile(device_type, world_size)
    try:
        planner = planner_for(training, world_size, algo, job, hw)
        plans = async_plans(planner)
    except ValueError as e:
        raise ValueError(f"--trainer.placement auto: {e}") from None
    if not plans:
        raise ValueError(f"--trainer.placement auto: no split of {world_size} ranks into a training and a rollout "
                         f"group fits this machine; name a placement (split, or a SPEC such as actor:0;rollout:1)")
    for line in describe_async(plans, planner):
        log(line)
    best = plans[0]
    train_ranks, rollout_ranks = async_ranks(best)
    return Placement({**{role: train_ranks for s in training for role in s}, ROLLOUT_ROLE: rollout_ranks})


def async_ranks(plan: AsyncPlan) -> tuple[list[int], list[int]]:
    """The training group on the first ranks (rank 0's actor leads the weight pushes), the rollout group after."""
    return list(range(plan.train_devices)), list(range(plan.train_devices, plan.train_devices + plan.rollout_devices))


def describe_async(plans: list[AsyncPlan], planner: FSDPPlanner) -> list[str]:
    """The chosen split and every other, fastest overlapped step first."""
    hw, work, best = planner.hw, planner.work, plans[0]
    train, rollout = async_ranks(best)
    lines = [f"placement auto: asynchronous {planner.flow.algo} on {planner.devices} x {hw.name}; {work.batch} prompts "
             f"x {work.samples}, {work.prompt_len} + {work.response_len} tokens",
             f"  chose training on ranks {ranks_text(train)}, rollout on ranks {ranks_text(rollout)}: predicted "
             f"{best.overlapped:.3g} s a step overlapped (generate {best.generate:.3g}, train {best.train:.3g}, "
             f"push {best.push:.3g}; {best.sync:.3g} synchronous)",
             "  candidates (rollout ranks | training ranks; predicted s a step, overlapped):"]
    lines += [f"    {p.name:<32} {p.overlapped:8.3g}" + ("   <- chosen" if p is best else "") for p in plans]
    return lines


def candidates(planner: FSDPPlanner, sets: list[list[str]]) -> list[Plan]:
    """Every grouping's best allocation, fastest first. An exact tie (the same ranks busy for
    the same time: sets of equal models swapped) goes to the recipe's own groupings:
    colocate, then split, then standalone."""
    preference = {"colocate": 0, "split": 1, "standalone": 2, "": 3}
    return sorted(planner.plan(), key=lambda p: (float(f"{p.step_time:.9g}"), preference[kind(p, sets)]))


def describe(plans: list[Plan], planner: FSDPPlanner, sets: list[list[str]], top: int = 8) -> list[str]:
    """The chosen plan and the candidates: every grouping's best allocation, fastest first (at
    most `top` besides colocate, split and standalone)."""
    hw, work, best = planner.hw, planner.work, plans[0]
    stages = [s.name for s in planner.flow.stages]
    where = (f"{hw.cores} cores, {hw.peak_flops / 1e9:.0f} GFLOP/s a rank, gloo {hw.nvlink_bandwidth / 1e9:.2f} GB/s "
             f"and {hw.nvlink_latency * 1e6:.0f} us" if hw.name == "cpu" else f"{hw.memory / GiB:.0f} GiB")
    lines = [f"placement auto: {planner.flow.algo} on {planner.devices} x {hw.name} ({where}); {work.batch} prompts "
             f"x {work.samples}, {work.prompt_len} + {work.response_len} tokens, {work.updates} update(s) a step",
             f"  chose {label(best, sets)} on ranks {' | '.join(ranks_text(r) for r in best.ranks)}: predicted "
             f"{best.step_time:.3g} s a step ("
             + ", ".join(f"{name} {t:.3g}" for name, t in zip(stages, best.stage_times)) + ")",
             "  candidates (each grouping's best allocation; ranks per set; predicted s a step):"]
    shown = [p for i, p in enumerate(plans) if i < top or kind(p, sets)]
    for p in shown:
        lines.append(f"    {label(p, sets):<48} {'/'.join(str(s.devices) for s in p.sets):<10} {p.step_time:8.3g}"
                     + ("   <- chosen" if p is best else ""))
    if len(shown) < len(plans):
        lines.append(f"    ... {len(plans) - len(shown)} more groupings, all slower")
    return lines


def label(plan: Plan, sets: list[list[str]]) -> str:
    name = " | ".join("+".join(s.roles) for s in plan.sets)
    return f"{kind(plan, sets)}: {name}" if kind(plan, sets) else name
