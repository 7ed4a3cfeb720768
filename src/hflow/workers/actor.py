"""The policy (Actor) and the frozen policy (Reference), FSDP2 on a causal LM.

    actor = cluster.spawn(Actor, ActorConfig(model_path=...))   # Actor(mesh, cfg) on each rank
    rollouts = actor.generate(prompts, RolloutConfig(n=4))       # Batch in the layout.py layout
    rollouts = rollouts | actor.log_probs(rollouts, 1.0)         # + old_log_probs [B, R]
    metrics = actor.update(rollouts, loss_fn)[0]                 # one dict per dp shard, all equal

Several generation rounds on one set of loaded weights (workers/hybrid_engine.py):

    actor.begin_rollout(rollout)                 # wake the engine, load the current weights
    first = actor.sample(prompts, rollout)       # any number of rounds
    second = actor.sample(next_prompts, rollout)
    actor.end_rollout()                          # sleep; update and load are refused until then

A loss function comes from the recipe and is called once per micro-batch:

    loss_fn(log_probs [b, r], micro_batch: Batch, entropy=None) -> (loss, metrics)

`micro_batch` holds the batch's tensors for those rows on the training device, with the
columns that are padding in every row trimmed (so r <= R); it must be picklable (a module-level
function or a functools.partial of one) to reach the workers.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
from tyro.conf import Suppress
from torch.distributed.device_mesh import DeviceMesh

from hflow.batch import Batch
from hflow.checkpoint import export_peft_adapter
from hflow.runtime.dispatch import dispatch
from hflow.faults import fault_point
from hflow.lora import LoRAConfig
from hflow.distributed.weight_sync import DEFAULT_BUCKET_BYTES, weight_manifest
from hflow import layout
from hflow.workers import packing
from hflow.workers.log_probs import token_log_probs
from hflow.workers.micro_batches import packed_row_tokens
from hflow.workers.moe_replay import MoEConfig, RoutingReplay, packed_routes
from hflow.workers.base import ModelWorker, TrainingConfig, as_tensors, batch_meta, is_on_policy
from hflow.workers.hf_model import build_model
from hflow.workers.hybrid_engine import HybridEngine
from hflow.workers.rollout_batches import RolloutConfig, prompt_token_lists, rollout_batch


@dataclass
class ActorConfig(TrainingConfig):
    """The policy model and how it is trained."""

    model_path: Suppress[str] = ""
    """Hugging Face directory of the policy (config.json + safetensors); recipes set it from --model.path"""
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    moe: MoEConfig = field(default_factory=MoEConfig)


class CausalLMWorker(ModelWorker):
    """A causal LM built from --actor.* and its response tokens' log-probs: what the Actor and
    the Reference share."""

    flag_prefix = "actor"
    trainable: bool
    output_key: str
    """the column log_probs writes"""

    def __init__(self, mesh: DeviceMesh, cfg: ActorConfig):
        if not cfg.model_path:
            raise ValueError(f"--{self.flag_prefix}.model-path is required (a Hugging Face directory)")
        model = build_model(cfg.model_path, mesh, cfg.fsdp, "causal_lm", trainable=self.trainable, lora_cfg=cfg.lora)
        super().__init__(mesh, model, cfg, cfg.optim if self.trainable else None)
        self.routing = RoutingReplay(self.model)

    def _log_probs(self, mb: dict[str, torch.Tensor], temperature: float, with_entropy: bool):
        """Per-token log-probs [b, R] of the responses, from one forward over the packed real
        tokens; only the positions that predict a response token go through the LM head."""
        packed = packing.pack(mb)
        if self.routing:   # the engine's experts compared with (and, replaying, used for) the trainer's
            self.routing.use(packed_routes(mb, packed.sources), self.cfg.moe.routing_replay)
        out = self.model(**packed.model_inputs(), logits_to_keep=packed.predict_at)
        # squeeze, not [0]: its backward is a view, where select's zero-fills and copies a [K, V] gradient
        logp, entropy = token_log_probs(out.logits.squeeze(0), packed.targets, temperature, with_entropy,
                                        grad_into_logits=torch.is_grad_enabled())
        return packed.unpack(logp), None if entropy is None else packed.unpack(entropy)

    @dispatch("dp", balance=packed_row_tokens)
    @torch.no_grad()
    def log_probs(self, batch, temperature: float = 1.0, with_entropy: bool = False,
                  key: str | None = None) -> Batch:
        """{key: [B, R] log-probs of the response tokens at `temperature`} (key: old_log_probs
        for the Actor, ref_log_probs for the Reference), plus `entropy` [B, R] if asked; 0
        outside response_mask."""
        key = key or self.output_key
        self.model.eval()
        fault_point("log_probs")

        def forward(mb):
            logp, entropy = self._log_probs(layout.trim_padding(mb), temperature, with_entropy)
            return {key: logp, **({"entropy": entropy} if with_entropy else {})}

        return Batch(self.forward_rows(as_tensors(batch), forward))


class Actor(CausalLMWorker):
    """The policy: rollouts, log-probs, PPO-style updates, checkpoints."""

    metric_prefix = "actor"
    trainable = True
    output_key = "old_log_probs"

    def __init__(self, mesh: DeviceMesh, cfg: ActorConfig):
        super().__init__(mesh, cfg)
        self.hybrid_engine = HybridEngine(mesh, self.model, cfg.model_path, cfg.fsdp)

    @dispatch("dp", balance=packed_row_tokens)
    def update(self, batch, loss_fn: Callable, temperature: float | None = None,
               with_entropy: bool = False, loss_agg: str = "token-mean") -> dict[str, float]:
        """Train on a batch: `cfg.epochs` passes, one optimizer step per mini-batch. The
        temperature must be the rollout's (default: batch.meta["temperature"], else 1); the
        samples per prompt are batch.meta["n"] (default 1). `loss_agg` is how `loss_fn`
        aggregates a micro-batch (algos.AGG_MODES): the update then gives exactly that
        aggregation over each whole mini-batch, on any micro-batching and number of ranks.
        Returns actor/loss, actor/grad_norm, actor/lr, actor/skipped_steps and the loss
        function's metrics as actor/<name>.

        A batch without `old_log_probs` is allowed for an on-policy update (one epoch, one
        mini-batch): the loss function then sees the detached current log-probs as the old
        ones (ratio exactly 1), which saves the forward pass that would compute them."""
        self._refuse_while_rollout_open("actor.update")
        meta = batch_meta(batch)
        temperature = temperature if temperature is not None else meta.get("temperature", 1.0)
        tensors, n = as_tensors(batch), int(meta.get("n", 1))
        current_as_old = "old_log_probs" not in tensors
        if current_as_old and not is_on_policy(self.cfg, len(tensors["input_ids"]) * self.mesh.size() // n):
            raise ValueError("the batch has no old_log_probs: only an on-policy update (--actor.epochs 1, "
                             "one mini-batch) may take the current log-probs as the old ones; compute them "
                             "with actor.log_probs or use the rollout's")

        def loss_of(mb):
            logp, entropy = self._log_probs(mb, temperature, with_entropy)
            if current_as_old:
                mb = {**mb, "old_log_probs": logp.detach()}
            loss, metrics = loss_fn(logp, self.wrap(mb, batch), entropy=entropy)
            if self.routing and "routed_experts" in mb:
                differ, compared = self.routing.disagreement()
                metrics = {**metrics, "moe_routing_disagreement": differ / max(compared, 1)}
            return loss, metrics

        fault_point("update")
        return self.train(tensors, n, loss_of, self.cfg.epochs, loss_agg)

    @dispatch("all")
    def export_hf(self, path: str, tokenizer: str | None = None) -> None:
        """A Hugging Face directory of the policy (ModelWorker.export_hf); with LoRA the adapters
        merged into it, and beside it `<path>_lora`, a PEFT adapter directory for the base."""
        # the adapter first: `path` appearing is what says the export (and the run) finished
        if self.cfg.lora.rank > 0:
            export_peft_adapter(self.model, f"{path}_lora", self.cfg.lora, self.cfg.model_path,
                                process_group=self.mesh.get_group())
        super().export_hf(path, tokenizer)

    @dispatch("all")
    def load(self, path: str) -> dict[str, tuple]:
        """Resume from `save(path)` (ModelWorker.load); refused while a rollout is open."""
        self._refuse_while_rollout_open("actor.load")
        return super().load(path)

    def _refuse_while_rollout_open(self, action: str) -> None:
        self.hybrid_engine.check_closed(action)

    @dispatch("all")
    def begin_rollout(self, rollout: RolloutConfig) -> None:
        """Wake the generation engine and load the current weights into it, resharded to its
        tensor-parallel size rollout.tp_size; `sample` then generates on them any number of
        times, until `end_rollout`. update and load are refused in between (the engine would
        keep the old weights)."""
        self.hybrid_engine.begin(rollout)

    @dispatch("dp")
    def sample(self, prompts: Batch, rollout: RolloutConfig, with_greedy: bool = False) -> Batch:
        """Sample `rollout.n` responses per prompt on the weights begin_rollout loaded (the
        engine's settings are begin_rollout's; the sampling fields and seed are this call's).
        `prompts` has a `prompt_ids` column (token-id lists) or left-padded `input_ids` +
        `attention_mask`; its other columns are repeated n times. Returns the sequences in the
        layout of hflow/layout.py plus `rollout_log_probs` and `finish_reason`, meta n and
        temperature. `with_greedy` adds a greedy response per prompt from the same engine call
        (see rollout.split_greedy)."""
        token_lists = prompt_token_lists(prompts)
        outputs = self.hybrid_engine.sample(token_lists, rollout, with_greedy)
        config = self.model.config
        pad_id = layout.pad_id(config)
        return rollout_batch(prompts, token_lists, outputs, rollout.n, pad_id, self.mesh, rollout.temperature,
                             with_greedy)

    @dispatch("all")
    def end_rollout(self) -> None:
        """Put the engine to sleep: its KV cache and (unless rollout.free_weights_when_asleep
        is off) its weights are freed."""
        self.hybrid_engine.end()

    @dispatch("one")
    def weight_manifest(self) -> list[tuple[str, tuple[int, ...]]]:
        """(name, shape) of every tensor push_weights sends, in order (hflow.distributed.weight_sync)."""
        return weight_manifest(self.model)

    @dispatch("all")
    def push_weights(self, receivers: list[int], bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> dict[str, float]:
        """Broadcast the current weights to a rollout group (workers/rollout.py) on the
        ranks `receivers`, whose receive_weights must be issued with it; bucket by bucket from
        this group's first rank. Returns push_s and push_bytes."""
        return self.hybrid_engine.push(list(receivers), bucket_bytes)

    @dispatch("dp")
    def generate(self, prompts: Batch, rollout: RolloutConfig, with_greedy: bool = False) -> Batch:
        """begin_rollout, sample and end_rollout in one call: `rollout.n` responses per prompt
        with the current weights (see sample)."""
        engine = self.hybrid_engine
        engine.begin(rollout)
        try:
            return self.sample(prompts, rollout, with_greedy)
        finally:
            engine.end()

    @dispatch("dp")
    def sample_agent(self, rows: Batch, env, rollout: RolloutConfig, limits=None) -> Batch:
        """`rollout.n` multi-turn trajectories per row on the weights begin_rollout loaded:
        `env` is an environment by name (hflow.agents.BUILTIN_ENVIRONMENTS), 'module:Class'
        or a class, built on this rank for each trajectory; `limits` an agents.AgentLimits.
        Returns the layout's tensors (response_mask 1 only on the model's tokens) and per-row
        trajectory_reward, finish_reason, turns, tool calls, prefill counts (see
        agent_rollout.sample_agent; hflow.agents.agent_rollout_metrics turns them into figures)."""
        from hflow.agents import AgentLimits
        from hflow.workers import agent_rollout
        llm = self.hybrid_engine.agent_engine(rollout)
        if getattr(self, "_agent_tokenizer", None) is None:
            from transformers import AutoTokenizer
            self._agent_tokenizer = AutoTokenizer.from_pretrained(self.cfg.model_path)
        config = self.model.config
        pad_id = layout.pad_id(config)
        # dispatch cuts the rows into equal contiguous shards in dp order: this shard's first global row
        offset = self.mesh.get_local_rank("dp") * len(rows) if "dp" in (self.mesh.mesh_dim_names or ()) else 0
        return agent_rollout.sample_agent(llm, rows, env, rollout, limits or AgentLimits(), self._agent_tokenizer,
                                          pad_id, self.mesh, row_offset=offset)

    @dispatch("dp")
    def generate_agent(self, rows: Batch, env, rollout: RolloutConfig, limits=None) -> Batch:
        """begin_rollout, sample_agent and end_rollout in one call."""
        engine = self.hybrid_engine
        engine.begin(rollout)
        try:
            return self.sample_agent(rows, env, rollout, limits)
        finally:
            engine.end()

    @staticmethod
    def wrap(mb: dict[str, torch.Tensor], like):
        """Hand the loss function the same kind of object the worker was given."""
        if isinstance(like, dict):
            return mb
        return Batch(mb, meta=batch_meta(like))


class Reference(CausalLMWorker):
    """The frozen initial policy: `log_probs` only (key ref_log_probs), no optimizer state, no
    engine."""

    metric_prefix = "ref"
    trainable = False
    output_key = "ref_log_probs"
