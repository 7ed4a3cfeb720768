"""Algorithm 1 of HybridFlow (§6): the placement of an RL dataflow's models with the fastest step.

    planner = Planner(dataflow("ppo", shapes), Workload(1024, 1024, 1024), PROFILES["a100"], 128)
    plans = planner.plan()          # the best allocation of every set partition, fastest first
    plans[0].placement()            # role -> ranks, as hflow.placement.split builds
    kind(plans[0], [["actor", "ref"], ["critic", "reward"]])   # 'colocate', 'split', 'standalone' or ''

1. Partition the models into colocated sets, every way there is (Bell numbers: 15 for PPO's
   four models, 203 for Safe-RLHF's six).
2. A set's minimum devices: the fewest with which its models' states fit in device memory
   (next to the largest training activations, or the actor's generation shard and at least
   one sequence of KV cache).
3. Every allocation of the devices to the sets, each at or above its minimum. Sizes are
   powers of two dividing a node below a node, whole nodes above, so that sets pack nodes.
4. auto_parallel (App. C, Algorithm 2) for each model of a set: every (p, t, d) with t inside
   a node and p dividing the layers; for the actor also every generation layout (p_g | p,
   t_g | t) the 3D-HybridEngine can reshard to. Memory couples a set's models (they hold
   their states together; the actor's KV cache gets what is left), so a set keeps the
   combination with the least busy time among those that fit, from each model's
   memory/time Pareto front. Cached per (model, devices) and per (set, devices).
5. Cost of an allocation = sum over stages of the max over sets of the sum within a set:
   colocated models take turns, sets run a stage's calls concurrently. On a CPU the ranks of
   concurrent sets share the cores (`shared_stage_time`).

`FSDPPlanner` (hflow.planner.fsdp) runs the same search over the layouts hflow itself runs.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from hflow.planner.hardware import Hardware
from hflow.planner.models import Dataflow, Model, Workload
from hflow.planner.simulator import (
    Parallel, activation_bytes, generate_time, generation_extra_bytes, infer_time, kv_bytes_per_token,
    reshard_time, state_bytes, train_time)


def set_partitions(items: list) -> list[list[list]]:
    """Every way to split `items` into non-empty sets (Bell(len(items)) of them)."""
    if not items:
        return [[]]
    first, partitions = items[0], []
    for rest in set_partitions(items[1:]):
        partitions.append([[first]] + rest)
        partitions += [rest[:i] + [[first] + s] + rest[i + 1:] for i, s in enumerate(rest)]
    return partitions


def device_counts(total: int, per_node: int) -> list[int]:
    """Set sizes the planner tries: powers of two dividing a node below a node (so that the
    sets of one node pack it), then whole nodes."""
    small = [2 ** i for i in range(per_node.bit_length()) if per_node % 2 ** i == 0 and 2 ** i < per_node]
    return sorted({n for n in small if n <= total} | set(range(per_node, total + 1, per_node)) | {total})


def divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


@dataclass(frozen=True)
class ModelPlan:
    """One model's strategy on its set's devices and its seconds in each stage."""
    role: str
    train: Parallel                       # training and inference layout
    stage_times: tuple[float, ...]
    states: float                         # bytes per device, held throughout
    activations: float                    # bytes per device while it trains
    gen: Parallel | None = None           # the actor's generation layout
    kv_cache: float = 0.0                 # bytes per device the actor's KV cache gets
    details: dict = field(default_factory=dict, compare=False, hash=False)

    @property
    def busy(self) -> float:
        return sum(self.stage_times)


@dataclass(frozen=True)
class SetPlan:
    roles: tuple[str, ...]
    devices: int
    models: tuple[ModelPlan, ...]
    stage_times: tuple[float, ...]
    memory: float                          # bytes per device: the states + the largest activations


@dataclass
class Plan:
    sets: list[SetPlan]
    ranks: list[list[int]]
    stage_times: tuple[float, ...]         # per stage: the slowest set's sum

    @property
    def step_time(self) -> float:
        return sum(self.stage_times)

    @property
    def name(self) -> str:
        return " | ".join("+".join(s.roles) for s in self.sets)

    def placement(self) -> dict[str, list[int]]:
        """role -> ranks, a plain dict: hflow.placement builds on the planner, not the reverse."""
        return {role: ranks for s, ranks in zip(self.sets, self.ranks) for role in s.roles}


def kind(plan: Plan, sets: list[list[str]]) -> str:
    """colocate, split (the recipe's sets), standalone, or '' for another grouping."""
    groups = sorted(sorted(s.roles) for s in plan.sets)
    if len(groups) == 1:
        return "colocate"
    if groups == sorted(sorted(s) for s in sets):
        return "split"
    return "standalone" if all(len(g) == 1 for g in groups) else ""


def ranks_text(ranks: list[int]) -> str:
    """[0, 1, 2] -> '0-2', [0, 2] -> '0,2': ranks as --trainer.placement's SPEC writes them."""
    return f"{ranks[0]}-{ranks[-1]}" if len(ranks) > 1 and ranks == list(range(ranks[0], ranks[-1] + 1)) \
        else ",".join(map(str, ranks))


def step_cost(sets: list[SetPlan], cores: int = 0, background: float = 0.0) -> tuple[float, ...]:
    """Per stage, the max over sets (concurrent) of the set's own sum (time-shared). With
    `cores` (ranks sharing a CPU), the stage's busy ranks share them: `shared_stage_time`."""
    stages = zip(*(s.stage_times for s in sets))
    if not cores:
        return tuple(max(times) for times in stages)
    return tuple(shared_stage_time([(s.devices, t) for s, t in zip(sets, times)], cores, background)
                 for times in stages)


def shared_stage_time(sets: list[tuple[int, float]], cores: float, background: float = 0.0) -> float:
    """Processor sharing: while k ranks are busy (and `background` processes of others), each
    runs at min(1, cores / (k + background)) of its full speed. `sets`: (ranks, seconds each
    rank needs at full speed); a set's ranks finish together, the shortest set first:
    T = sum over sets in order of (t_i - t_(i-1)) / rate(ranks still busy)."""
    clock, done = 0.0, 0.0
    busy = sum(n for n, t in sets if t > 0)
    for t, n in sorted((t, n) for n, t in sets if t > 0):
        clock += (t - done) / min(1.0, cores / (busy + background))
        done, busy = t, busy - n
    return clock


def assign_ranks(sizes: list[int]) -> list[list[int]]:
    """Consecutive ranks, largest set first: whole-node sets stay node-aligned, and the smaller
    ones (powers of two dividing a node) then never straddle a node boundary."""
    order = sorted(range(len(sizes)), key=lambda i: -sizes[i])
    ranks, start = [None] * len(sizes), 0
    for i in order:
        ranks[i] = list(range(start, start + sizes[i]))
        start += sizes[i]
    return ranks


@dataclass
class _Point:     # a combination of co-resident models' strategies
    states: float
    activations: float
    stage_times: tuple[float, ...]
    models: tuple[ModelPlan, ...]

    @property
    def busy(self) -> float:
        return sum(self.stage_times)


def _pareto(points: list[_Point], memory: float) -> list[_Point]:
    """Drop points that don't fit or that another beats on busy time, states and activations."""
    kept, least_states = [], {}       # activations (few distinct values) -> least states kept
    for p in sorted(points, key=lambda p: (p.busy, p.states, p.activations)):
        if p.states + p.activations > memory:
            continue
        if not any(a <= p.activations and s <= p.states for a, s in least_states.items()):
            kept.append(p)
            least_states[p.activations] = min(p.states, least_states.get(p.activations, math.inf))
    return kept


class Planner:
    def __init__(self, flow: Dataflow, work: Workload, hw: Hardware, devices: int):
        per_node = hw.devices_per_node
        if devices < 1 or (devices > per_node and devices % per_node):
            raise ValueError(f"--gpus {devices}: give at most one node ({per_node}) or whole nodes "
                             f"(a multiple of --gpus-per-node {per_node})")
        if work.sequences % work.updates:
            raise ValueError(f"--updates {work.updates} must divide the {work.sequences} sequences of a step")
        self.flow, self.work, self.hw, self.devices = flow, work, hw, devices
        self.sizes = device_counts(devices, per_node)
        self.shared_cores = hw.cores * math.ceil(devices / per_node)
        self.stages = len(flow.stages)
        self._options: dict = {}
        self._sets: dict = {}
        self._generation: dict = {}

    # -- auto_parallel ------------------------------------------------------------------------
    def parallels(self, role: str, n: int) -> list[Parallel]:
        """(p, t, d) on n devices: t divides a node (TP never crosses one), the heads and the KV
        heads; p divides the layers; every replica gets a sequence per optimizer step."""
        model, work = self.flow.models[role], self.work
        shape, per_node = model.shape, self.hw.devices_per_node
        per_replica = work.sequences // work.updates if model.trained else work.sequences
        out = []
        for t in divisors(math.gcd(n, per_node)):
            if shape.heads % t or shape.kv_heads % t:
                continue
            for p in divisors(shape.layers):
                if n % (p * t) == 0 and n // (p * t) <= per_replica:
                    out.append(Parallel(p, t, n // (p * t)))
        return out

    def model_options(self, role: str, n: int) -> list[ModelPlan]:
        """Every strategy of one model on n devices with its inference and training seconds
        per stage (generation is added by the set, which knows the memory left)."""
        key = (role, n)
        if key not in self._options:
            model = self.flow.models[role]
            options = []
            for par in self.parallels(role, n):
                times, details = [0.0] * self.stages, {}
                for stage, call in self.flow.calls_of(role):
                    if call.kind == "infer":
                        details["infer"] = self.infer_parts(model, par, call.repeat)
                        times[stage] += sum(details["infer"].values())
                    elif call.kind == "train":
                        details["train"] = self.train_parts(model, par)
                        times[stage] += sum(details["train"].values())
                options.append(ModelPlan(role, par, tuple(times), self.state_bytes(model, par),
                                         self.activation_bytes(model, par), details=details))
            self._options[key] = options
        return self._options[key]

    # the simulator's terms for Megatron layouts (hflow.planner.fsdp prices hflow's own)
    def train_parts(self, model: Model, par: Parallel) -> dict[str, float]:
        return train_time(model, par, self.work, self.hw)

    def infer_parts(self, model: Model, par: Parallel, repeat: int) -> dict[str, float]:
        return infer_time(model, par, self.work, self.hw, repeat)

    def state_bytes(self, model: Model, par: Parallel) -> float:
        return state_bytes(model, par, self.hw.weight_bytes)

    def activation_bytes(self, model: Model, par: Parallel) -> float:
        return activation_bytes(model, par, self.work, self.hw.weight_bytes)

    def generation_extra_bytes(self, model: Model, train: Parallel, gen: Parallel) -> float:
        return generation_extra_bytes(model, train, gen, self.hw.weight_bytes)

    def reshard_seconds(self, model: Model, train: Parallel, gen: Parallel) -> float:
        return reshard_time(model, train, gen, self.hw)

    def generation_parallels(self, train: Parallel, n: int) -> list[Parallel]:
        return [Parallel(p, t, n // (p * t)) for p in divisors(train.p) for t in divisors(train.t)
                if n // (p * t) <= self.work.sequences]

    def _generation_seconds(self, role: str, gen: Parallel, running: int, repeat: int) -> dict:
        key = (role, gen, running, repeat)
        if key not in self._generation:
            self._generation[key] = generate_time(self.flow.models[role], gen, self.work, self.hw, running, repeat)
        return self._generation[key]

    # -- one set on n devices -----------------------------------------------------------------
    def set_plan(self, roles: tuple[str, ...], n: int) -> SetPlan | None:
        """The set's fastest combination of strategies that fits in memory (None: none fits)."""
        key = (roles, n)
        if key not in self._sets:
            self._sets[key] = self._best_set_plan(roles, n)
        return self._sets[key]

    def _best_set_plan(self, roles: tuple[str, ...], n: int) -> SetPlan | None:
        memory = self.hw.memory
        generators = [r for r in roles if any(c.kind == "generate" for _, c in self.flow.calls_of(r))]
        front = [_Point(0.0, 0.0, (0.0,) * self.stages, ())]
        for role in roles:
            if role in generators:
                continue
            front = _pareto([_Point(p.states + o.states, max(p.activations, o.activations),
                                    tuple(a + b for a, b in zip(p.stage_times, o.stage_times)), p.models + (o,))
                             for p in front for o in self.model_options(role, n)], memory)
        if not generators:
            if not front:
                return None
            best = front[0]
            return SetPlan(roles, n, best.models, best.stage_times, best.states + best.activations)
        return self._with_generator(roles, generators[0], front, n)

    def _with_generator(self, roles, role: str, front: list[_Point], n: int) -> SetPlan | None:
        """Add the actor: its training layout, and the generation layout and KV cache that
        give the set the least busy time with the memory the others leave."""
        model, hw, work, memory = self.flow.models[role], self.hw, self.work, self.hw.memory
        (stage, call), = [(i, c) for i, c in self.flow.calls_of(role) if c.kind == "generate"]
        best, best_busy = None, math.inf
        front = sorted(front, key=lambda p: p.busy)
        for base in self.model_options(role, n):
            layouts = []
            for gen in self.generation_parallels(base.train, n):
                per_replica = math.ceil(work.sequences * call.repeat / gen.d)
                # one wave (all of a replica's sequences at once) is the fastest generation can be
                fastest = self._generation_seconds(role, gen, per_replica, call.repeat)
                reshard = self.reshard_seconds(model, base.train, gen)
                layouts.append((gen, self.generation_extra_bytes(model, base.train, gen),
                                kv_bytes_per_token(model, gen, hw.weight_bytes) * work.seq_len, per_replica,
                                reshard, fastest["prefill"] + fastest["decode"] + reshard))
            for point in front:
                states = point.states + base.states
                busy_before = point.busy + base.busy
                if busy_before >= best_busy:
                    break
                if states + max(point.activations, base.activations) > memory:
                    continue
                for gen, extra, per_sequence, per_replica, reshard, fastest in layouts:
                    if busy_before + fastest >= best_busy:
                        continue
                    kv = memory - states - extra
                    kv = min(kv, hw.kv_cache_cap) if hw.kv_cache_cap else kv
                    running = min(per_replica, int(kv // per_sequence))
                    if running < 1:
                        continue
                    generate = self._generation_seconds(role, gen, running, call.repeat)
                    busy = busy_before + generate["prefill"] + generate["decode"] + reshard
                    if busy < best_busy:
                        best_busy, best = busy, (base, point, gen, kv, generate, reshard)
        if best is None:
            return None
        base, point, gen, kv, generate, reshard = best
        times = list(base.stage_times)
        times[stage] += generate["prefill"] + generate["decode"] + reshard
        actor = ModelPlan(role, base.train, tuple(times), base.states, base.activations, gen, kv,
                          details={**base.details, "generate": generate, "reshard": reshard})
        models = {m.role: m for m in point.models + (actor,)}
        states = point.states + base.states
        return SetPlan(roles, n, tuple(models[r] for r in roles),
                       tuple(a + b for a, b in zip(point.stage_times, times)),
                       states + max(point.activations, base.activations))

    def min_devices(self, roles: tuple[str, ...]) -> int | None:
        """get_min_alloc: the fewest devices on which the set fits (None: not even on all)."""
        return next((n for n in self.sizes if self.set_plan(roles, n) is not None), None)

    # -- Algorithm 1 ----------------------------------------------------------------------------
    def best_allocation(self, partition: list[tuple[str, ...]]) -> Plan | None:
        minimums = [self.min_devices(s) for s in partition]
        if any(m is None for m in minimums):
            return None
        best = None
        for sizes in self._allocations(minimums, self.devices):
            plan = self.price(partition, sizes)
            if plan is not None and (best is None or plan.step_time < best.step_time):
                best = plan
        return best

    def price(self, partition: list[tuple[str, ...]], sizes: list[int]) -> Plan | None:
        """These sets on these many devices each (None: a set does not fit, or has more
        devices than a model's batch has sequences)."""
        sets = [self.set_plan(tuple(s), n) for s, n in zip(partition, sizes)]
        if None in sets:
            return None
        return Plan(sets, assign_ranks(list(sizes)), step_cost(sets, self.shared_cores, self.hw.background))

    def _allocations(self, minimums: list[int], total: int):
        """Every list of sizes (one per set, at or above its minimum) adding up to total."""
        if len(minimums) == 1:
            if total in self.sizes and total >= minimums[0]:
                yield [total]
            return
        for n in self.sizes:
            if minimums[0] <= n <= total - sum(minimums[1:]):
                for rest in self._allocations(minimums[1:], total - n):
                    yield [n] + rest

    def plan(self) -> list[Plan]:
        """The best allocation of every partition that fits, fastest step first."""
        roles = list(self.flow.models)
        plans = [self.best_allocation([tuple(s) for s in partition]) for partition in set_partitions(roles)]
        plans = sorted((p for p in plans if p is not None), key=lambda p: p.step_time)
        if not plans:
            raise ValueError(self._no_fit_message())
        return plans

    def _no_fit_message(self) -> str:
        hw, gib = self.hw, 1024 ** 3
        need = sum(min(o.states for o in self.model_options(r, self.devices)) for r in self.flow.models
                   if self.model_options(r, self.devices))
        return (f"the models do not fit in {self.devices} devices of {hw.memory / gib:.0f} GiB: their "
                f"states alone need {need / gib:.1f} GiB a device even fully sharded, before activations "
                f"and KV cache; give more --gpus or more --gpu-memory, or smaller models")
