"""python -m hflow.planner plan: the placement with the fastest simulated RL step.

    python -m hflow.planner plan --gpus 128 --gpus-per-node 8 --gpu-memory 80 --gpu a100 \\
      --actor 13B --critic 13B --reference 13B --reward 13B --algo ppo --batch 1024 \\
      --prompt-len 1024 --response-len 1024
    python -m hflow.planner plan --gpu cpu --gpus 4 --actor path/to/config.json --algo grpo ...
    python -m hflow.planner plan --layouts hflow ...       # as --trainer.placement auto prices a run

Prints the chosen placement (its sets, their devices, each model's (p, t, d) for training and
for generation), its seconds per stage and per step, and the runners-up: colocate, split,
standalone and the best of the other partitions. Roles the algorithm has but the command
doesn't size take the actor's size; `--reference none` (or reward, for GRPO/PPO) drops one.
`--layouts megatron` (default) searches the paper's (p, t, d); `hflow` the layouts hflow runs:
FSDP2 over each set's ranks and the engine at --generation-tp (hflow.planner.fsdp). On
`--gpu cpu` the ranks are planned with one thread each, as torchrun starts them.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
import time

from hflow.planner.asynchronous import AsyncPlan, async_plans
from hflow.planner.fsdp import FSDPPlanner
from hflow.planner.hardware import PROFILES, GiB, cpu_profile
from hflow.planner.models import ALGORITHMS, Workload, dataflow, model_shape
from hflow.planner.search import Plan, Planner, kind as grouping_kind, ranks_text

ROLE_FLAGS = {"actor": "actor", "critic": "critic", "ref": "reference", "reward": "reward",
              "cost": "cost", "cost_critic": "cost-critic"}


def parse_args(argv):
    parser = argparse.ArgumentParser(prog="python -m hflow.planner", description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    plan = commands.add_parser("plan", help="search placements (HybridFlow Algorithm 1) and print the best")
    plan.add_argument("--algo", default="ppo", choices=list(ALGORITHMS))
    plan.add_argument("--gpus", type=int, required=True, help="devices in all")
    plan.add_argument("--gpus-per-node", type=int, help="devices a node (default: the profile's; cpu: --gpus)")
    plan.add_argument("--gpu", default="a100", choices=[*PROFILES, "cpu"],
                      help="hardware profile; cpu is measured on this machine")
    plan.add_argument("--gpu-memory", type=float, help="GiB a device (default: the profile's)")
    plan.add_argument("--network-gbps", type=float,
                      help="Gb/s a node sends to other nodes, shared by its devices (default: the profile's; "
                           "DGX A100: 8 x 200)")
    for role, flag in ROLE_FLAGS.items():
        plan.add_argument(f"--{flag}", dest=role, metavar="SIZE",
                          help="7B/13B/34B/70B or a config.json" + ("" if role == "actor" else "; none drops it"))
    plan.add_argument("--batch", type=int, default=1024, help="prompts a step")
    plan.add_argument("--samples", type=int, default=1, help="responses a prompt")
    plan.add_argument("--prompt-len", type=int, default=1024)
    plan.add_argument("--response-len", type=int, default=1024)
    plan.add_argument("--updates", type=int, default=1, help="optimizer steps a training stage (mini-batches x epochs; the recipes' default: 1)")
    plan.add_argument("--async", dest="asynchronous", action="store_true",
                      help="also price asynchronous steps: generation on a rollout group of its own, overlapped "
                           "with training (hflow's --trainer.async-steps)")
    plan.add_argument("--top", type=int, default=5, help="other partitions listed besides colocate/split/standalone")
    plan.add_argument("--layouts", default="megatron", choices=["megatron", "hflow"],
                      help="the paper's (p, t, d), or hflow's FSDP2 + engine (what --trainer.placement auto prices)")
    plan.add_argument("--generation-tp", type=int, default=1, help="--layouts hflow: the engine's tensor-parallel size")
    plan.add_argument("--micro-batch-tokens", type=int, default=4096,
                      help="--layouts hflow: tokens of one micro-batch on a rank (--actor.max-tokens-per-micro-batch)")
    return parser.parse_args(argv)


def hardware(args):
    if args.gpu == "cpu":
        hw = cpu_profile(args.gpus_per_node or args.gpus,
                         memory=args.gpu_memory * GiB if args.gpu_memory else None, threads_per_rank=1)
    else:
        hw = PROFILES[args.gpu]
        per_node = args.gpus_per_node or hw.devices_per_node
        changes = {"devices_per_node": per_node, "memory": args.gpu_memory and args.gpu_memory * GiB,
                   "network_bandwidth": args.network_gbps and args.network_gbps * 1e9 / 8 / per_node}
        hw = dataclasses.replace(hw, **{k: v for k, v in changes.items() if v})
    return hw


def kind(plan: Plan, roles: list[str]) -> str:
    """colocate, split (actor + reference | the others, as the recipes split), standalone or ''."""
    return grouping_kind(plan, [["actor", "ref"], [r for r in roles if r not in ("actor", "ref")]])


def par_text(par) -> str:
    return f"({par.p},{par.t},{par.d})" if par else "-"


def describe(plan: Plan, planner: Planner) -> list[str]:
    stages = [s.name for s in planner.flow.stages]
    lines = [f"  {'set':<28}{'devices':>8}  {'ranks':<9}{'model':<12}{'train (p,t,d)':<15}"
             f"{'generate (p,t,d)':<18}memory/device"]
    for s, ranks in zip(plan.sets, plan.ranks):
        for i, m in enumerate(s.models):
            head = f"  {'+'.join(s.roles) if i == 0 else '':<28}{s.devices if i == 0 else '':>8}  " \
                   f"{ranks_text(ranks) if i == 0 else '':<9}"
            memory = f"{m.states / GiB:.1f} GiB states"
            if m.activations:
                memory += f", {m.activations / GiB:.1f} activations"
            if m.gen:
                waves = m.details["generate"]["waves"]
                memory += f", {m.kv_cache / GiB:.1f} KV cache ({waves} wave{'s' * (waves > 1)})"
            lines.append(f"{head}{m.role:<12}{par_text(m.train):<15}{par_text(m.gen):<18}{memory}")
    lines.append(f"  {'stage':<14}{'seconds':>9}   per set")
    for i, name in enumerate(stages):
        per_set = " | ".join(f"{'+'.join(s.roles)} {s.stage_times[i]:.1f}" for s in plan.sets)
        lines.append(f"  {name:<14}{plan.stage_times[i]:>9.1f}   {per_set}")
    lines.append(f"  {'step':<14}{plan.step_time:>9.1f}")
    return lines


def main(argv=None) -> int:
    args = parse_args(argv)
    algo = ALGORITHMS[args.algo]
    if not args.actor:
        sys.exit("plan: give the actor's size, e.g. --actor 13B (or a config.json)")
    try:
        shapes = {role: None if (getattr(args, role) or args.actor).lower() == "none"
                  else model_shape(getattr(args, role) or args.actor)
                  for role in ROLE_FLAGS if role in algo["roles"]}
        flow = dataflow(args.algo, shapes)
        work = Workload(args.batch, args.prompt_len, args.response_len, args.samples, args.updates,
                        args.micro_batch_tokens if args.layouts == "hflow" else 0)
        hw = hardware(args)
        planner = FSDPPlanner(flow, work, hw, args.gpus, args.generation_tp) if args.layouts == "hflow" \
            else Planner(flow, work, hw, args.gpus)
        start = time.perf_counter()
        plans = planner.plan()
        seconds = time.perf_counter() - start
    except ValueError as e:
        sys.exit(f"plan: {e}")
    roles = list(flow.models)
    best = plans[0]
    print(f"{args.algo}: {args.gpus} x {hw.name} ({hw.memory / GiB:.0f} GiB, {hw.devices_per_node} a node), "
          f"{work.batch} prompts x {work.samples}, {work.prompt_len} + {work.response_len} tokens, "
          f"{work.updates} updates a step; {len(plans)} placements fit, searched in {seconds:.1f} s")
    print(f"\nchosen: {best.name}" + (f"  ({kind(best, roles)})" if kind(best, roles) else ""))
    print("\n".join(describe(best, planner)))
    named = {kind(p, roles): p for p in reversed(plans) if kind(p, roles)}
    others = [p for p in plans[1:] if not kind(p, roles)][:args.top]
    print("\nrunners-up (each placement's best allocation):")
    print(f"  {'placement':<44}{'devices':<16}{'step s':>8}{'vs chosen':>11}")
    for p in sorted([*named.values(), *others], key=lambda p: p.step_time):
        if p is best:
            continue
        label = f"{kind(p, roles)}: {p.name}" if kind(p, roles) else p.name
        print(f"  {label:<44}{'/'.join(str(s.devices) for s in p.sets):<16}{p.step_time:>8.1f}"
              f"{100 * (p.step_time / best.step_time - 1):>+10.1f}%")
    missing = [k for k in ("colocate", "split", "standalone") if k not in named and k != kind(best, roles)]
    if missing:
        print(f"  (does not fit: {', '.join(missing)})")
    if args.asynchronous:
        print("\n".join(describe_async(async_plans(planner), best)))
    return 0


def describe_async(plans: list[AsyncPlan], best: Plan) -> list[str]:
    """The asynchronous splits against the chosen synchronous placement."""
    if not plans:
        return ["\nasynchronous: no split into a rollout and a training group fits"]
    lines = ["\nasynchronous steps (a rollout group of its own; every other model on the training group):",
             f"  {'split':<28}{'generate':>9}{'train':>8}{'push':>7}{'sync s':>8}{'async s':>9}{'vs chosen':>11}"]
    for p in plans:
        lines.append(f"  {p.name:<28}{p.generate:>9.1f}{p.train:>8.1f}{p.push:>7.2f}{p.sync:>8.1f}{p.overlapped:>9.1f}"
                     f"{100 * (p.overlapped / best.step_time - 1):>+10.1f}%")
    fastest = plans[0]
    verdict = "beats" if fastest.overlapped < best.step_time else "does not beat"
    lines.append(f"  the fastest asynchronous split ({fastest.name}, {fastest.overlapped:.1f} s) {verdict} the chosen "
                 f"synchronous placement ({best.step_time:.1f} s)")
    return lines


if __name__ == "__main__":
    sys.exit(main())
