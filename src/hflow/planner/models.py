"""What the planner places: model shapes, the roles of each algorithm, and its dataflow's stages.

    shape = model_shape("13B")                       # Llama-2 13B; or a path to a config.json
    flow = dataflow("ppo", {"actor": shape, "critic": shape, "ref": shape, "reward": shape})
    flow.models["critic"].trained                    # True
    [s.name for s in flow.stages]                    # ['generation', 'preparation', 'training']

A stage is a set of calls that may run at the same time on disjoint devices (the dataflow's
data dependencies order the stages, nothing orders the calls inside one). Every call reads or
writes whole sequences (prompt + response); `Workload` says how many and how long.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

from hflow.validation import ConfigError, read_json_object


@dataclass(frozen=True)
class ModelShape:
    """A Llama-family decoder (RMSNorm, SwiGLU MLP, grouped-query attention, rotary: no
    position embeddings)."""
    name: str
    layers: int
    hidden: int
    ffn: int
    heads: int
    kv_heads: int
    vocab: int
    head_dim: int = 0                # 0: hidden // heads
    tied_embeddings: bool = False

    @property
    def q_dim(self) -> int:
        return self.heads * (self.head_dim or self.hidden // self.heads)

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * (self.head_dim or self.hidden // self.heads)

    def layer_matmul_params(self) -> int:
        attention = self.hidden * (2 * self.q_dim + 2 * self.kv_dim)      # q, o; k, v
        return attention + 3 * self.hidden * self.ffn                      # gate, up, down

    def head_params(self, value_head: bool) -> int:
        return self.hidden if value_head else self.vocab * self.hidden

    def params(self, value_head: bool = False) -> int:
        norms = (2 * self.layers + 1) * self.hidden
        embedding = self.vocab * self.hidden
        head = 0 if self.tied_embeddings and not value_head else self.head_params(value_head)
        return self.layers * self.layer_matmul_params() + norms + embedding + head


LLAMA = {   # Llama-2 7B/13B/70B and CodeLlama-34B (the paper's "Llama 34B"), from their config.json
    "7B": ModelShape("7B", layers=32, hidden=4096, ffn=11008, heads=32, kv_heads=32, vocab=32000),
    "13B": ModelShape("13B", layers=40, hidden=5120, ffn=13824, heads=40, kv_heads=40, vocab=32000),
    "34B": ModelShape("34B", layers=48, hidden=8192, ffn=22016, heads=64, kv_heads=8, vocab=32000),
    "70B": ModelShape("70B", layers=80, hidden=8192, ffn=28672, heads=64, kv_heads=8, vocab=32000),
}


def model_shape(size_or_config: str) -> ModelShape:
    """'7B' / '13B' / '34B' / '70B', or a Hugging Face config.json (or the directory holding it)."""
    if size_or_config.upper() in LLAMA:
        return LLAMA[size_or_config.upper()]
    path = os.path.join(size_or_config, "config.json") if os.path.isdir(size_or_config) else size_or_config
    if not os.path.isfile(path):
        raise ValueError(f"model size {size_or_config!r}: give one of {', '.join(LLAMA)} or the path "
                         f"of a Hugging Face config.json (or of its directory)")
    config = read_json_object(path)
    config = config.get("text_config", config)
    try:
        return ModelShape(
            name=os.path.basename(os.path.dirname(os.path.abspath(path))) or path,
            layers=config["num_hidden_layers"], hidden=config["hidden_size"],
            ffn=config["intermediate_size"], heads=config["num_attention_heads"],
            kv_heads=config.get("num_key_value_heads") or config["num_attention_heads"],
            vocab=config["vocab_size"], head_dim=config.get("head_dim") or 0,
            tied_embeddings=bool(config.get("tie_word_embeddings", False)))
    except KeyError as e:
        raise ConfigError(f"{path}: not a decoder config the planner can read (no {e.args[0]})") from None


@dataclass(frozen=True)
class Model:
    role: str
    shape: ModelShape
    trained: bool          # holds fp32 gradients and Adam states, runs a training stage
    value_head: bool       # a scalar head (critics, reward and cost models) instead of the LM head


@dataclass(frozen=True)
class Call:
    role: str
    kind: str              # "generate", "infer" (log-probs, values, scores) or "train"
    repeat: int = 1        # ReMax generates and scores twice: sampled and greedy responses


@dataclass(frozen=True)
class Stage:
    name: str
    calls: tuple[Call, ...]


@dataclass(frozen=True)
class Dataflow:
    algo: str
    models: dict[str, Model]
    stages: tuple[Stage, ...]

    def calls_of(self, role: str) -> list[tuple[int, Call]]:
        return [(i, c) for i, stage in enumerate(self.stages) for c in stage.calls if c.role == role]


@dataclass(frozen=True)
class Workload:
    """One RL step: `batch` prompts, `samples` responses each, every sequence `prompt_len` +
    `response_len` tokens (the paper forces the response length), `updates` optimizer steps
    (mini-batches x epochs) per training stage. hflow's layouts (hflow.planner.fsdp) cut a
    rank's share of a mini-batch into micro-batches of `micro_batch_tokens` (0: one)."""
    batch: int
    prompt_len: int
    response_len: int
    samples: int = 1
    updates: int = 8
    micro_batch_tokens: int = 0

    @property
    def sequences(self) -> int:
        return self.batch * self.samples

    @property
    def seq_len(self) -> int:
        return self.prompt_len + self.response_len


# role -> (trained, value head); `required` roles can't be dropped with `--<role> none`
ROLES = {"actor": (True, False), "critic": (True, True), "ref": (False, False),
         "reward": (False, True), "cost": (False, True), "cost_critic": (True, True)}

ALGORITHMS = {
    # the actor recomputes its log-probs in its training layout in the preparation stage
    "ppo": dict(roles=["actor", "critic", "ref", "reward"], required=["actor", "critic"],
                stages=[("generation", [Call("actor", "generate")]),
                        ("preparation", [Call("actor", "infer"), Call("ref", "infer"),
                                         Call("critic", "infer"), Call("reward", "infer")]),
                        ("training", [Call("actor", "train"), Call("critic", "train")])]),
    "grpo": dict(roles=["actor", "ref", "reward"], required=["actor"],
                 stages=[("generation", [Call("actor", "generate")]),
                         ("preparation", [Call("actor", "infer"), Call("ref", "infer"),
                                          Call("reward", "infer")]),
                         ("training", [Call("actor", "train")])]),
    # the greedy response is the baseline: generated and scored besides the sampled one
    "remax": dict(roles=["actor", "ref", "reward"], required=["actor", "reward"],
                  stages=[("generation", [Call("actor", "generate", repeat=2)]),
                          ("preparation", [Call("actor", "infer"), Call("ref", "infer"),
                                           Call("reward", "infer", repeat=2)]),
                          ("training", [Call("actor", "train")])]),
    "safe-rlhf": dict(roles=["actor", "critic", "ref", "reward", "cost", "cost_critic"],
                      required=["actor", "critic", "reward", "cost", "cost_critic"],
                      stages=[("generation", [Call("actor", "generate")]),
                              ("preparation", [Call("actor", "infer"), Call("ref", "infer"),
                                               Call("reward", "infer"), Call("cost", "infer"),
                                               Call("critic", "infer"), Call("cost_critic", "infer")]),
                              ("training", [Call("actor", "train"), Call("critic", "train"),
                                            Call("cost_critic", "train")])]),
}


def dataflow(algo: str, shapes: dict[str, ModelShape | None], *, require: bool = True,
             actor_log_probs: bool = True) -> Dataflow:
    """The algorithm's models (roles given a shape; None drops an optional role) and stages.
    `require=False` lets any role go (a recipe scores with a rule instead of a reward model);
    `actor_log_probs=False` drops the actor's recomputation of its log-probs (hflow takes the
    engine's when they are exact, in fp32)."""
    if algo not in ALGORITHMS:
        raise ValueError(f"--algo {algo!r}: choose one of {', '.join(ALGORITHMS)}")
    spec = ALGORITHMS[algo]
    unknown = set(shapes) - set(spec["roles"])
    if unknown:
        raise ValueError(f"{algo} has no role {', '.join(sorted(unknown))} (its roles: {', '.join(spec['roles'])})")
    for role in spec["required"] if require else ["actor"]:
        if shapes.get(role) is None:
            raise ValueError(f"{algo} needs a {role} model: give --{role.replace('_', '-')} SIZE")
    models = {role: Model(role, shapes[role], *ROLES[role]) for role in spec["roles"] if shapes.get(role)}
    def kept(call: Call) -> bool:
        return call.role in models and (actor_log_probs or (call.role, call.kind) != ("actor", "infer"))

    stages = tuple(Stage(name, tuple(filter(kept, calls))) for name, calls in spec["stages"])
    return Dataflow(algo, models, stages)
