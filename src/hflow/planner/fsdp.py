"""The simulator and planner for the layouts hflow itself runs: FSDP2 training, a tp x dp engine.

    planner = FSDPPlanner(dataflow("ppo", shapes), Workload(32, 16, 5, samples=4, updates=1,
                          micro_batch_tokens=8192), cpu_profile(4), 4, generation_tp=1)
    planner.plan()[0].placement()        # role -> ranks

The paper's planner (hflow.planner.search) searches Megatron's (p, t, d). hflow trains every
model with FSDP2 over its set's n ranks (every parameter sharded n ways; the layout is (1, 1, n))
and generates with the actor's engine in tp_g x (n / tp_g), tp_g = --rollout.tp-size. Per call:

- training: per optimizer step, each rank's ceil(sequences / updates / n) sequences in
  micro-batches of `micro_batch_tokens`; each micro-batch all-gathers the weights in the compute
  dtype (once: hflow keeps them gathered from forward to backward on CPU; twice on GPUs, where
  they are freed after the forward) and reduce-scatters the fp32 gradients; compute-bound
  FLOPs as the paper's simulator; Adam streams its shard (28 bytes a parameter: read weight,
  gradient, m, v; write weight, m, v) at the memory bandwidth.
- inference (log-probs, values, scores): a forward over ceil(sequences / n) rows; one all-gather
  per micro-batch, or one per call where the weights stay gathered (CPU).
- generation: the actor's weights go from the FSDP shard (1/n) to the engine's (1/tp_g), each
  rank receiving (1/tp_g - 1/n) of them, one redistribute per parameter tensor; then the
  roofline decode of hflow.planner.simulator.generate_time on (1, tp_g, n / tp_g).

Every collective of a set of n ranks makes each rank receive (n - 1)/n of the gathered bytes
(ring) at the profile's link bandwidth, plus its latency once per collective: one per FSDP unit
(each decoder layer, then the root). Memory per rank: fp32 shards of weights, gradients and
Adam's m and v (16 bytes a trained parameter, 4 a frozen one) over n; while a model works, its
gathered weights (the whole model where they stay gathered, else two units) and one
micro-batch's activations; while generating, the engine's copy of the weights (1/tp_g) and
the KV cache.

On CPU, a model whose copies fit in a quarter of the host's memory is replicated on each of its set's
ranks instead (hflow's default there, hflow.workers.fsdp.resolve_shard_size): no gathers and
no resharding, the gradients all-reduced, the whole state on every rank.

On a CPU (`hw.cores`), ranks share the machine's cores: `step_cost` shares them among a
stage's busy ranks (hflow.planner.search.shared_stage_time), so that 4 colocated ranks on
2 cores take twice as long as 2, and sets on ranks of their own run side by side only as far
as there are cores for them.
"""
from __future__ import annotations

import math

from hflow.planner.hardware import Hardware
from hflow.planner.models import Dataflow, Model, Workload
from hflow.planner.search import Planner
from hflow.planner.simulator import Parallel, forward_flops

ADAM_BYTES = 28      # fp32 Adam: read weight, gradient, m, v; write weight, m, v
LOGIT_CHUNK = 1024   # hflow computes log-probs over 1024 positions at a time


def fsdp_units(model: Model) -> int:
    """Collectives per pass over the weights: FSDP2 shards each decoder layer, then the root."""
    return model.shape.layers + 1


def parameter_tensors(model: Model) -> int:
    """Tensors the engine's weights are redistributed in: 9 a Llama layer (q, k, v, o, gate,
    up, down, two norms), the embedding, the final norm and an untied head."""
    untied = model.value_head or not model.shape.tied_embeddings
    return 9 * model.shape.layers + 2 + untied


def collective_time(nbytes: float, n: int, hw: Hardware, collectives: int = 1) -> float:
    """An all-gather (or reduce-scatter) of `nbytes` over n ranks in `collectives` calls: each
    rank receives (n - 1)/n of them, and each call pays the link's latency."""
    if n == 1:
        return 0.0
    bandwidth, latency = hw.link(n > hw.devices_per_node)
    return (n - 1) / n * nbytes / bandwidth + collectives * latency


def micro_batches(rows: int, work: Workload) -> int:
    """Micro-batches of one rank's `rows` sequences under the token budget (0: one)."""
    if not work.micro_batch_tokens:
        return 1
    return max(1, math.ceil(rows * work.seq_len / work.micro_batch_tokens))


def fsdp_train_time(model: Model, n: int, work: Workload, hw: Hardware, keep_gathered: bool,
                    replicated: bool = False) -> dict[str, float]:
    """One training stage on n FSDP2 ranks: `work.updates` optimizer steps. `replicated`: every
    rank holds all the weights (HSDP, shard groups of 1): nothing to gather, the gradients
    all-reduced (twice a reduce-scatter's bytes), Adam over the whole model on every rank."""
    params, w, updates = model.shape.params(model.value_head), hw.weight_bytes, work.updates
    rows = math.ceil(work.sequences / updates / n)
    micro, units = micro_batches(rows, work), fsdp_units(model)
    gathers = 0 if replicated else micro * (1 if keep_gathered else 2)
    return {
        "compute": 3 * forward_flops(model, work.seq_len) * rows * updates / (hw.peak_flops * hw.efficiency.train),
        "gather": updates * gathers * collective_time(w * params, n, hw, units),
        "reduce_scatter": updates * micro * (2 if replicated else 1) * collective_time(4 * params, n, hw, units),
        # a streaming kernel, priced as decode's weight reads
        "optimizer": updates * ADAM_BYTES * params / (1 if replicated else n)
                     / (hw.memory_bandwidth * hw.efficiency.generation),
    }


def fsdp_infer_time(model: Model, n: int, work: Workload, hw: Hardware, keep_gathered: bool,
                    repeat: int = 1, replicated: bool = False) -> dict[str, float]:
    """One forward over every sequence (x repeat), ceil(sequences / n) rows a rank."""
    rows = math.ceil(work.sequences * repeat / n)
    gathers = 0 if replicated else 1 if keep_gathered else micro_batches(rows, work)
    return {
        "compute": forward_flops(model, work.seq_len) * rows / (hw.peak_flops * hw.efficiency.inference),
        "gather": gathers * collective_time(hw.weight_bytes * model.shape.params(model.value_head), n, hw,
                                            fsdp_units(model)),
    }


def fsdp_state_bytes(model: Model, n: int, replicated: bool = False) -> float:
    """fp32 shards a rank holds throughout: weights, and for a trained model gradients and
    Adam's m, v; all of them on every rank when `replicated`."""
    return (16 if model.trained else 4) * model.shape.params(model.value_head) / (1 if replicated else n)


def fsdp_working_bytes(model: Model, n: int, work: Workload, weight_bytes: int, keep_gathered: bool) -> float:
    """A rank's peak while the model trains (or, frozen, runs a forward): its gathered weights,
    and for a trained model one micro-batch's activations (Korthikanti et al.: 34 s h bytes a
    layer in 16 bits) and the fp32 logits of a chunk."""
    shape = model.shape
    unit = max(shape.layer_matmul_params() + 2 * shape.hidden, shape.vocab * shape.hidden)
    gathered = weight_bytes * (shape.params(model.value_head) if keep_gathered else 2 * unit)
    if not model.trained:
        return gathered
    rows = math.ceil(work.sequences / work.updates / n)
    tokens = math.ceil(rows / micro_batches(rows, work)) * work.seq_len
    logits = 4 * min(tokens, LOGIT_CHUNK) * (1 if model.value_head else shape.vocab)
    return gathered + 34 * tokens * shape.hidden * shape.layers * weight_bytes / 2 + logits


def fsdp_reshard_bytes(model: Model, n: int, tp: int, weight_bytes: int) -> float:
    """Bytes a rank receives going from its FSDP shard (1/n) to its engine shard (1/tp_g),
    which contains it (hflow.distributed.reshard)."""
    return weight_bytes * model.shape.params(model.value_head) * (1 / tp - 1 / n)


def fsdp_reshard_time(model: Model, n: int, tp: int, hw: Hardware) -> float:
    if n == tp:
        return 0.0
    bandwidth, latency = hw.link(n > hw.devices_per_node)
    return fsdp_reshard_bytes(model, n, tp, hw.weight_bytes) / bandwidth + parameter_tensors(model) * latency


class FSDPPlanner(Planner):
    """Algorithm 1 over hflow's layouts: every set size from 1 rank up inside a node (any
    grouping of ranks is a mesh), FSDP2 on all of a set's ranks, the engine at `generation_tp`.
    A trained model's set must split each mini-batch evenly over its ranks, as hflow requires."""

    def __init__(self, flow: Dataflow, work: Workload, hw: Hardware, devices: int, generation_tp: int = 1):
        super().__init__(flow, work, hw, devices)
        if devices <= hw.devices_per_node:
            self.sizes = list(range(1, devices + 1))
        self.generation_tp = generation_tp
        # hflow's FSDPConfig.reshard_after_forward default: keep the weights gathered on CPU
        self.keep_gathered = hw.name == "cpu"

    def replicated(self, model: Model) -> bool:
        """hflow's FSDPConfig.shard_size default (hflow.workers.fsdp.resolve_shard_size): on CPU
        each rank holds all of a model while its copies fit (`hw.memory` is one rank's share)."""
        from hflow.workers.fsdp import replicas_fit   # the run's own rule (torch, transformers: only here)
        return self.hw.name == "cpu" and replicas_fit(fsdp_state_bytes(model, 1), self.hw.memory)

    def parallels(self, role: str, n: int) -> list[Parallel]:
        trained = self.flow.models[role].trained
        if trained and (self.work.sequences // self.work.updates) % n:
            return []
        return [Parallel(1, 1, n)]

    def generation_parallels(self, train: Parallel, n: int) -> list[Parallel]:
        tp = self.generation_tp
        return [Parallel(1, tp, n // tp)] if n % tp == 0 else []

    def train_parts(self, model: Model, par: Parallel) -> dict[str, float]:
        return fsdp_train_time(model, par.d, self.work, self.hw, self.keep_gathered, self.replicated(model))

    def infer_parts(self, model: Model, par: Parallel, repeat: int) -> dict[str, float]:
        return fsdp_infer_time(model, par.d, self.work, self.hw, self.keep_gathered, repeat, self.replicated(model))

    def state_bytes(self, model: Model, par: Parallel) -> float:
        return fsdp_state_bytes(model, par.d, self.replicated(model))

    def activation_bytes(self, model: Model, par: Parallel) -> float:
        return fsdp_working_bytes(model, par.d, self.work, self.hw.weight_bytes,
                                  self.keep_gathered or self.replicated(model))

    def generation_extra_bytes(self, model: Model, train: Parallel, gen: Parallel) -> float:
        return self.hw.weight_bytes * model.shape.params(model.value_head) / gen.t   # the engine's own copy

    def reshard_seconds(self, model: Model, train: Parallel, gen: Parallel) -> float:
        return 0.0 if self.replicated(model) else fsdp_reshard_time(model, train.d, gen.t, self.hw)
