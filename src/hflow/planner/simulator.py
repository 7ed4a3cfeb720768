"""The simulator: seconds and bytes of one model's work under one parallel strategy (p, t, d).

Three analytical models, as the paper's App. C (after LLM-Analysis, roofline analysis and
DistServe), each a sum of terms a test checks by hand:

- training and inference are compute-bound: FLOPs / (devices x peak x efficiency), plus the
  tensor-parallel all-reduces (NVLink: TP stays inside a node), the pipeline bubble and its
  point-to-point sends, and (training) the data-parallel gradient reduction per optimizer step;
- generation is memory-bandwidth-bound: each decode step reads the device's weights and its
  sequences' KV cache from HBM (or is compute-bound, whichever is slower: the roofline), the
  prefill is compute-bound; the KV cache that fits bounds how many sequences run at once;
- the actor's train -> generate transition moves the 3D-HybridEngine's resharding bytes,
  (p t - p_g t_g) / (p_g t_g p t) x M per device, over NVLink or the network.

Layout (Megatron's rank order: t fastest, then d, then p): a TP group is t consecutive ranks,
a DP group spans t x d ranks (the network once that exceeds a node), pipeline stages are
t x d ranks apart. The network is the device's share of its node's NICs.

Memory per device (Megatron mixed precision with its distributed optimizer): bf16 weights and
fp32 gradients sharded over p x t; fp32 master weights and Adam's two moments (12 bytes a
parameter; 8 when the weights already are fp32) sharded over p x t x d; frozen models hold
their weights only. Training activations with selective recomputation (Korthikanti et al.
2022): 34 s h bytes a layer per sequence in 16 bits, / t; 1F1B keeps p micro-batches of L/p
layers in flight, so L layers in all; plus the fp32 logits. Micro-batches are one sequence.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from hflow.planner.hardware import Hardware
from hflow.planner.models import Model, Workload


@dataclass(frozen=True)
class Parallel:
    p: int     # pipeline stages
    t: int     # tensor-parallel size (inside a node)
    d: int     # data-parallel replicas (for generation: engine replicas)

    @property
    def size(self) -> int:
        return self.p * self.t * self.d

    def __str__(self) -> str:
        return f"(p={self.p}, t={self.t}, d={self.d})"


def forward_flops(model: Model, seq_len: int, p: int = 1) -> float:
    """One sequence's forward on the slowest of p pipeline stages (the last: L / p layers and
    the output head): 2 FLOPs per weight per token, plus causal attention's QK^T and AV,
    2 q_dim s^2 a layer (each token attends to the ones before it)."""
    shape = model.shape
    layer = 2 * shape.layer_matmul_params() * seq_len + 2 * shape.q_dim * seq_len ** 2
    return shape.layers / p * layer + 2 * shape.head_params(model.value_head) * seq_len


def stage_params(model: Model, p: int) -> float:
    """Parameters of the heaviest of p pipeline stages: L / p layers, plus the input embedding
    (first stage) or the output head and final norm (last stage); all of them when p = 1."""
    shape = model.shape
    if p == 1:
        return shape.params(model.value_head)
    layer = shape.layer_matmul_params() + 2 * shape.hidden
    return shape.layers / p * layer + max(shape.vocab * shape.hidden, shape.head_params(model.value_head) + shape.hidden)


def allreduce_time(nbytes: float, group: int, hw: Hardware, crosses_nodes: bool) -> float:
    """Ring all-reduce: each device sends and receives 2 (g-1)/g of the buffer."""
    if group == 1:
        return 0.0
    bandwidth, latency = hw.link(crosses_nodes)
    return 2 * (group - 1) / group * nbytes / bandwidth + latency


def send_time(nbytes: float, hw: Hardware, crosses_nodes: bool) -> float:
    bandwidth, latency = hw.link(crosses_nodes)
    return nbytes / bandwidth + latency


def dp_crosses_nodes(par: Parallel, hw: Hardware) -> bool:
    return par.t * par.d > hw.devices_per_node


def pp_crosses_nodes(par: Parallel, hw: Hardware) -> bool:
    return par.size > hw.devices_per_node


def train_time(model: Model, par: Parallel, work: Workload, hw: Hardware) -> dict[str, float]:
    """One training stage: `work.updates` optimizer steps over all sequences, per replica
    ceil(sequences / updates / d) sequences a step, pipelined one sequence a micro-batch."""
    shape, s, w = model.shape, work.seq_len, hw.weight_bytes
    per_step = math.ceil(work.sequences / work.updates / par.d)
    sequences = per_step * work.updates
    # 1F1B runs at the pace of its slowest stage
    compute = 3 * forward_flops(model, s, par.p) * sequences / (par.t * hw.peak_flops * hw.efficiency.train)
    activation = s * shape.hidden * w
    parts = {
        "compute": compute,
        # 1F1B's bubble: p - 1 micro-batch slots idle for every per_step that work
        "bubble": (par.p - 1) / per_step * compute,
        # forward 2 and backward 2 all-reduces of the layer's activation, for each layer held
        "tp": shape.layers / par.p * sequences * 4 * allreduce_time(activation, par.t, hw, False),
        # each micro-batch: the activation forward, its gradient backward (1/t each: scatter-gather)
        "pp": 0.0 if par.p == 1 else sequences * 2 * send_time(activation / par.t, hw, pp_crosses_nodes(par, hw)),
        "dp": 0.0,
    }
    if par.d > 1:   # distributed optimizer: reduce-scatter fp32 gradients, all-gather the weights
        bandwidth, latency = hw.link(dp_crosses_nodes(par, hw))
        shard = stage_params(model, par.p) / par.t
        parts["dp"] = work.updates * ((par.d - 1) / par.d * (4 + w) * shard / bandwidth + 2 * latency)
    return parts


def infer_time(model: Model, par: Parallel, work: Workload, hw: Hardware, repeat: int = 1) -> dict[str, float]:
    """One forward over every sequence (log-probs, values or scores), ceil(sequences / d) a
    replica, pipelined one sequence a micro-batch."""
    shape, s = model.shape, work.seq_len
    sequences = math.ceil(work.sequences * repeat / par.d)
    compute = forward_flops(model, s, par.p) * sequences / (par.t * hw.peak_flops * hw.efficiency.inference)
    activation = s * shape.hidden * hw.weight_bytes
    return {
        "compute": compute,
        "bubble": (par.p - 1) / sequences * compute,
        "tp": shape.layers / par.p * sequences * 2 * allreduce_time(activation, par.t, hw, False),
        "pp": 0.0 if par.p == 1 else sequences * send_time(activation / par.t, hw, pp_crosses_nodes(par, hw)),
    }


def kv_bytes_per_token(model: Model, gen: Parallel, weight_bytes: int) -> float:
    """K and V of one token on one device: its L / p_g layers, its share of the KV heads
    (replicated when there are fewer KV heads than t_g)."""
    shape = model.shape
    head_dim = shape.kv_dim // shape.kv_heads
    return 2 * shape.layers / gen.p * math.ceil(shape.kv_heads / gen.t) * head_dim * weight_bytes


def sum_of_max_lines(a1: float, b1: float, a2: float, b2: float, steps: int) -> float:
    """sum over k = 0 .. steps-1 of max(a1 + b1 k, a2 + b2 k), in closed form."""
    def line_sum(a, b, lo, hi):
        return (hi - lo) * a + b * (lo + hi - 1) * (hi - lo) / 2 if hi > lo else 0.0

    if b1 == b2:
        return line_sum(max(a1, a2), b1, 0, steps)
    cross = min(max(math.ceil((a2 - a1) / (b1 - b2)), 0), steps)   # first k where line 1 >= line 2 (b1 > b2)
    if b1 > b2:
        return line_sum(a2, b2, 0, cross) + line_sum(a1, b1, cross, steps)
    cross = min(max(math.ceil((a1 - a2) / (b2 - b1)), 0), steps)
    return line_sum(a1, b1, 0, cross) + line_sum(a2, b2, cross, steps)


def wave_time(model: Model, gen: Parallel, work: Workload, hw: Hardware, running: int) -> dict[str, float]:
    """`running` sequences of one engine replica from prompt to the last response token. With
    p_g stages, p_g micro-batches are in flight and the slowest stage (the last: L / p_g
    layers and the head) sets the pace."""
    shape, w, eff = model.shape, hw.weight_bytes, hw.efficiency
    prompt, flops_rate = work.prompt_len, hw.peak_flops * eff.inference
    prefill = running * forward_flops(model, prompt, gen.p) / (gen.t * flops_rate) * (1 + (gen.p - 1) / running)
    prefill += shape.layers / gen.p * running * 2 * allreduce_time(prompt * shape.hidden * w, gen.t, hw, False)
    # decode step at context c: the stage reads its weights once per micro-batch (p_g times)
    # and its layers' KV of every sequence, or computes, whichever is slower (the roofline)
    stage_matmul = shape.layers / gen.p * shape.layer_matmul_params() + shape.head_params(model.value_head)
    kv = kv_bytes_per_token(model, gen, w)
    hbm = hw.memory_bandwidth * eff.generation
    mem_a, mem_b = (gen.p * stage_matmul * w / gen.t + running * prompt * kv) / hbm, running * kv / hbm
    attention = 4 * shape.layers / gen.p * shape.q_dim
    flop_a = running * (2 * stage_matmul + attention * prompt) / (gen.t * flops_rate)
    flop_b = running * attention / (gen.t * flops_rate)
    rows = math.ceil(running / gen.p) * shape.hidden * w
    comm = 2 * shape.layers * allreduce_time(rows, gen.t, hw, False)
    if gen.p > 1:
        comm += gen.p * send_time(rows / gen.t, hw, pp_crosses_nodes(gen, hw))
    decode = sum_of_max_lines(mem_a, mem_b, flop_a, flop_b, work.response_len) + work.response_len * comm
    return {"prefill": prefill, "decode": decode}


def generate_time(model: Model, gen: Parallel, work: Workload, hw: Hardware, running: int,
                  repeat: int = 1) -> dict[str, float]:
    """Every replica's share of the sequences, in waves of `running`: as many as the KV cache
    holds at full length (responses are forced to full length), at most the replica's share."""
    if running < 1:
        return {"prefill": math.inf, "decode": math.inf, "waves": 0}
    per_replica = math.ceil(work.sequences * repeat / gen.d)
    full, rest = divmod(per_replica, running)
    total = {k: full * v for k, v in wave_time(model, gen, work, hw, running).items()}
    if rest:
        for k, v in wave_time(model, gen, work, hw, rest).items():
            total[k] += v
    return {**total, "waves": full + bool(rest)}


def reshard_bytes(model: Model, train: Parallel, gen: Parallel, weight_bytes: int) -> float:
    """Bytes each device receives going from the training shard to the generation shard that
    contains it (3D-HybridEngine, Table 2): (p t - p_g t_g) / (p_g t_g p t) x M."""
    size = model.shape.params(model.value_head) * weight_bytes
    pt, pt_g = train.p * train.t, gen.p * gen.t
    return (pt - pt_g) / (pt_g * pt) * size


def reshard_time(model: Model, train: Parallel, gen: Parallel, hw: Hardware) -> float:
    nbytes = reshard_bytes(model, train, gen, hw.weight_bytes)
    if nbytes == 0:
        return 0.0
    # the micro-DP group gathers across pipeline stages, which sit on other nodes beyond one
    crosses = gen.p < train.p and train.size > hw.devices_per_node
    return send_time(nbytes, hw, crosses)


def state_bytes(model: Model, par: Parallel, weight_bytes: int) -> float:
    """Weights (+ fp32 gradients and the distributed optimizer's shard) on one device."""
    shard = stage_params(model, par.p) / par.t
    if not model.trained:
        return weight_bytes * shard
    optimizer = 8 + (4 if weight_bytes < 4 else 0)     # Adam m, v (+ fp32 master weights)
    return (weight_bytes + 4) * shard + optimizer * shard / par.d


def activation_bytes(model: Model, par: Parallel, work: Workload, weight_bytes: int) -> float:
    """Peak training activations on one device (0 for frozen models: a forward keeps one layer)."""
    if not model.trained:
        return 0.0
    shape, s = model.shape, work.seq_len
    logits = 4 * s * (1 if model.value_head else shape.vocab)
    return (34 * s * shape.hidden * shape.layers * weight_bytes / 2 + logits) / par.t


def generation_extra_bytes(model: Model, train: Parallel, gen: Parallel, weight_bytes: int) -> float:
    """The generation shard's bytes beyond the training shard it contains (zero redundancy)."""
    size = model.shape.params(model.value_head) * weight_bytes
    return size / (gen.p * gen.t) - size / (train.p * train.t)
