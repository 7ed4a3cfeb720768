"""Asynchronous schedules priced beside Algorithm 1's synchronous placements.

    plans = async_plans(planner)          # every rollout / training split of the devices
    plans[0].overlapped                   # the fastest one's seconds a step, generation overlapped

hflow's asynchronous steps (hflow.recipe_kit.async_rollouts, `--trainer.async-steps k`) put the actor's engine
on a rollout group of its own and every model of the dataflow, the actor's training included, on
the other devices. For each split, n_g rollout devices and n_t = N - n_g training ones:

    generate   the step's generation on the n_g devices (the engine's best layout there, the KV
               cache what the weights leave);
    train      the training group's step without generation: every other stage of the dataflow,
               its models colocated on the n_t devices (the set Algorithm 1 prices), less the
               actor's generation and resharding;
    push       the actor's weights, once, from one device to the rollout group (the bucketed
               broadcast: the weights' bytes over the link, plus a latency per tensor);
    sync       generation on its own devices, one group waiting for the other:
               generate + push + train (on a CPU each phase at the speed its ranks get there);
    overlapped async, k >= 1: the steady state of the pipeline, max(generate, train + push) (the
               push waits for the generation running, so it sits on the training side). On a CPU
               the two groups' ranks share the cores while both run (`shared_stage_time`).

A larger k does not change the steady state: it only absorbs a step whose generation runs long
(the variance this model leaves out), at the price of staler samples.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from hflow.planner.fsdp import parameter_tensors
from hflow.planner.search import Planner, shared_stage_time
from hflow.planner.simulator import Parallel, kv_bytes_per_token


ROLLOUT_ROLE = "rollout"   # the placement role of hflow's rollout group (--trainer.async-steps)


@dataclass(frozen=True)
class AsyncPlan:
    rollout_devices: int
    train_devices: int
    generate: float
    train: float
    push: float
    gen: Parallel            # the rollout group's engine layout

    sync: float = 0.0
    overlapped: float = 0.0

    @property
    def name(self) -> str:
        return f"rollout {self.rollout_devices} | training {self.train_devices}"


def generator_role(planner: Planner) -> tuple[str, int]:
    """The model that generates, and how many responses a prompt it generates per sample (ReMax: 2)."""
    for role in planner.flow.models:
        for _, call in planner.flow.calls_of(role):
            if call.kind == "generate":
                return role, call.repeat
    raise ValueError(f"{planner.flow.algo}: no model generates")


def rollout_generation(planner: Planner, role: str, repeat: int, n: int) -> tuple[float, Parallel] | None:
    """The fastest generation of a step's sequences on n devices that hold the engine only."""
    model, hw, work = planner.flow.models[role], planner.hw, planner.work
    t_max = math.gcd(n, hw.devices_per_node)
    best = None
    for gen in planner.generation_parallels(Parallel(1, t_max, max(1, n // t_max)), n):
        if model.shape.heads % gen.t or model.shape.kv_heads % gen.t or gen.p * gen.t * gen.d != n:
            continue
        weights = hw.weight_bytes * model.shape.params(model.value_head) / (gen.p * gen.t)
        kv = hw.memory - weights
        kv = min(kv, hw.kv_cache_cap) if hw.kv_cache_cap else kv
        per_replica = math.ceil(work.sequences * repeat / gen.d)
        running = min(per_replica, int(kv // (kv_bytes_per_token(model, gen, hw.weight_bytes) * work.seq_len)))
        if running < 1:
            continue
        seconds = planner._generation_seconds(role, gen, running, repeat)
        total = seconds["prefill"] + seconds["decode"]
        if best is None or total < best[0]:
            best = (total, gen)
    return best


def async_plans(planner: Planner) -> list[AsyncPlan]:
    """Every split of the devices into a rollout and a training group that fits, fastest
    overlapped step first."""
    role, repeat = generator_role(planner)
    roles, hw, devices = tuple(planner.flow.models), planner.hw, planner.devices
    model = planner.flow.models[role]
    bandwidth, latency = hw.link(devices > hw.devices_per_node)
    push = hw.weight_bytes * model.shape.params(model.value_head) / bandwidth + parameter_tensors(model) * latency
    plans = []
    for n_g in planner.sizes:
        n_t = devices - n_g
        if n_t < 1 or n_t not in planner.sizes:
            continue
        training = planner.set_plan(roles, n_t)
        generation = rollout_generation(planner, role, repeat, n_g)
        if training is None or generation is None:
            continue
        actor = next(m for m in training.models if m.role == role)
        own = actor.details["generate"]
        train = sum(training.stage_times) - own["prefill"] - own["decode"] - actor.details["reshard"]
        generate, gen = generation
        if hw.cores:   # one machine's cores: a group alone may not fill them, both together share them
            cores, background = planner.shared_cores, hw.background
            sync = (shared_stage_time([(n_g, generate)], cores, background)
                    + shared_stage_time([(n_t, train + push)], cores, background))
            overlapped = shared_stage_time([(n_g, generate), (n_t, train + push)], cores, background)
        else:
            sync, overlapped = generate + push + train, max(generate, train + push)
        plans.append(AsyncPlan(n_g, n_t, generate, train, push, gen, sync=sync, overlapped=overlapped))
    return sorted(plans, key=lambda p: p.overlapped)
