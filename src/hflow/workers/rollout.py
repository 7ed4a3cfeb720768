"""The rollout role: a generation engine on ranks that do not train, fed by the actor's pushes.

    rollout = cluster.spawn(Rollout, actor_cfg, cfg.rollout, ranks=placement["rollout"])
    manifest = actor.weight_manifest()
    pushed = actor.push_weights.future(rollout.ranks)                       # the actor's side
    rollout.receive_weights(version, manifest, actor.ranks[0])             # both at once
    batch = rollout.generate(prompts, rollout_cfg)   # + policy_version per row, rollout_busy_s / rollout_idle_s in meta
    batch = rollout.generate_agent(rows, env, rollout_cfg, limits)   # multi-turn trajectories, versions per turn

Its engine stays awake between rollouts (nothing else uses these ranks) and keeps the last
weights it received, with their policy version (the number of actor updates behind them), which
every sample it generates records. hflow.recipe_kit.async_rollouts runs it ahead of training.

Partial rollouts (`partial`): the controller also tells the group at once that a push has begun
(offer_weights, a @dispatch("notice") call that does not wait behind the running generate);
between two engine steps the generate joins that push, and the engine goes on with the new
weights from where each response is (LLM.load_weights recomputes their KV). Each token then
records the version that sampled it (`token_policy_version`); `policy_version` is a row's first.
A multi-turn rollout (generate_agent) takes offered weights between engine steps and also while
every trajectory waits for its tool calls; its turns record their versions (workers/agent_rollout.py:
a trajectory whose turns several versions sampled says so in `turn_policy_version`).
"""
from __future__ import annotations

import time

import torch
from torch.distributed.device_mesh import DeviceMesh
from transformers import AutoConfig

from hflow import layout
from hflow.batch import Batch
from hflow.runtime.dispatch import dispatch
from hflow.faults import fault_point
from hflow.distributed.parallel import device_of, local_group, make_mesh
from hflow.distributed.reshard import generation_mesh
from hflow.distributed.weight_sync import DEFAULT_BUCKET_BYTES, Manifest, joint_ranks, receive_weights
from hflow.workers.fsdp import mixed_precision
from hflow.workers.hybrid_engine import build_engine, sample_on
from hflow.workers.lockstep_engine import EngineGroup
from hflow.workers.rollout_batches import RolloutConfig, prompt_token_lists, rollout_batch


class Rollout:
    """The engine of one rollout rank, its (tp, dp) mesh over the rollout ranks, and the
    policy version of the weights it holds (None until the first push)."""

    def __init__(self, mesh: DeviceMesh, actor_cfg, rollout: RolloutConfig, partial: bool = False):
        if partial and rollout.tp_size > 1:
            raise ValueError("partial rollouts with --rollout.tp-size > 1: the tensor-parallel ranks would have to "
                             "agree on the step at which the weights change; not supported")
        self.mesh, self.cfg, self.partial = mesh, rollout, partial
        self.device = device_of(mesh)
        # the engine computes in the actor's compute dtype, as the actor's own engine would
        self.dtype = mixed_precision(actor_cfg.fsdp, self.device).param_dtype or torch.float32
        self.config = AutoConfig.from_pretrained(actor_cfg.model_path)
        self.model_path, self.tokenizer = actor_cfg.model_path, None   # the tokenizer: for multi-turn rollouts
        self.gen_mesh = generation_mesh(mesh, rollout.tp_size, make_mesh)
        self.llm = build_engine(self.config, actor_cfg.model_path, self.dtype, self.device, self.gen_mesh, rollout)
        self.version: int | None = None
        self.offered = -1     # the newest version the actor is pushing or has pushed (offer_weights)
        self.push_from: tuple | None = None   # (manifest, source, bucket_bytes): the same for every push
        self.last_end = time.perf_counter()   # when the rollout last finished generating (idle since)

    @classmethod
    def check_arguments(cls, ranks: int, actor_cfg=None, rollout: RolloutConfig | None = None,
                        partial: bool = False) -> None:
        if rollout is not None and ranks % rollout.tp_size:
            raise ValueError(f"--rollout.tp-size {rollout.tp_size} does not divide the rollout group's {ranks} ranks")

    @dispatch("all")
    def receive_weights(self, version: int, manifest: Manifest, source: int,
                        bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> float:
        """Load the weights the actor's rank `source` broadcasts (its push_weights, issued at
        the same time) into the engine in place; they are policy `version`. Returns the
        seconds this took, most of it waiting for the actor to finish its update (0 when a
        partial rollout took them already)."""
        began = time.perf_counter()
        self.push_from = (manifest, source, bucket_bytes)
        if self.version is None or self.version < version:
            self._receive(version)
        return time.perf_counter() - began

    @dispatch("notice")
    def offer_weights(self, version: int) -> None:
        """The actor has begun to push `version` (runs at once, beside a running generate)."""
        self.offered = max(self.offered, version)

    @torch.no_grad()
    def _receive(self, version: int) -> None:
        manifest, source, bucket_bytes = self.push_from
        group = local_group(joint_ranks(source, self.mesh.mesh.flatten().tolist()))
        fault_point("handoff")
        self.llm.load_weights(receive_weights(manifest, self.dtype, self.device, group, source, bucket_bytes))
        self.version = version

    def _take_offered(self) -> None:
        """Between two engine steps of a partial rollout: join the pushes offered, one version
        at a time (each is the actor's next broadcast)."""
        while self.offered > self.version:
            self._receive(self.version + 1)

    @dispatch("dp")
    def generate(self, prompts: Batch, rollout: RolloutConfig) -> Batch:
        """`rollout.n` responses per prompt on the last weights received (see Actor.sample), each
        row with its `policy_version`; meta `rollout_busy_s` (this call) and `rollout_idle_s`
        (since the last one ended: waiting for weights or for the next call)."""
        if self.version is None:
            raise RuntimeError("Rollout.generate before any receive_weights: the engine holds no weights yet")
        if rollout.tp_size != self.cfg.tp_size:
            raise ValueError(f"generate with --rollout.tp-size {rollout.tp_size} on a rollout group built with "
                             f"{self.cfg.tp_size}")
        began, first_version = time.perf_counter(), self.version
        token_lists = prompt_token_lists(prompts)
        outputs = sample_on(self.llm, self.gen_mesh, token_lists, rollout, False,
                            show=rollout.progress and self.mesh.get_local_rank() == 0,
                            between_steps=self._take_offered if self.partial else None)
        pad_id = layout.pad_id(self.config)
        batch = rollout_batch(prompts, token_lists, outputs, rollout.n, pad_id, self.mesh, rollout.temperature)
        batch["policy_version"] = torch.full((len(batch),), first_version, dtype=torch.long)
        if self.partial:   # each load between steps is the next version, from that token on
            versions = torch.full(batch["response_mask"].shape, first_version, dtype=torch.long)
            changes = [sample.weight_changes for request in outputs for sample in request.outputs]
            for row, at in enumerate(changes):
                for t in at:
                    versions[row, t:] += 1
            batch["token_policy_version"] = versions
        ended = time.perf_counter()
        batch.meta.update(rollout_busy_s=ended - began, rollout_idle_s=began - self.last_end)
        self.last_end = ended
        return batch

    @dispatch("dp")
    def generate_agent(self, rows: Batch, env, rollout: RolloutConfig, limits=None) -> Batch:
        """`rollout.n` multi-turn trajectories per row on the last weights received (see
        Actor.sample_agent), with the policy versions that sampled them: policy_version per row,
        token_policy_version per token, turn_policy_version per model turn (-1 past the last);
        meta rollout_busy_s and rollout_idle_s as generate's. With partial rollouts, weights
        pushed meanwhile are taken between two engine steps (or while every trajectory waits
        for its tools) and the trajectories go on with them."""
        from hflow.agents import AgentLimits
        from hflow.workers import agent_rollout
        if self.version is None:
            raise RuntimeError("Rollout.generate_agent before any receive_weights: the engine holds no weights yet")
        if rollout.tp_size != self.cfg.tp_size:
            raise ValueError(f"generate_agent with --rollout.tp-size {rollout.tp_size} on a rollout group built with "
                             f"{self.cfg.tp_size}")
        began = time.perf_counter()
        if self.tokenizer is None:
            from transformers import AutoTokenizer
            self.tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        fault_point("generate")
        engine = self.llm if self.cfg.tp_size == 1 else EngineGroup(self.llm, self.gen_mesh)
        # dispatch cuts the rows into equal contiguous shards in dp order: this shard's first global row
        offset = self.mesh.get_local_rank("dp") * len(rows) if "dp" in (self.mesh.mesh_dim_names or ()) else 0
        limits, pad_id = limits or AgentLimits(), layout.pad_id(self.config)
        batch = agent_rollout.sample_agent(engine, rows, env, rollout, limits, self.tokenizer, pad_id, self.mesh,
                                           row_offset=offset, version=lambda: self.version,
                                           between_steps=self._take_offered if self.partial else None)
        ended = time.perf_counter()
        batch.meta.update(rollout_busy_s=ended - began, rollout_idle_s=began - self.last_end)
        self.last_end = ended
        return batch

    @dispatch("one")
    def engine_weights(self) -> dict[str, torch.Tensor]:
        """The engine's weights on the group's first rank (fused storage, as the engine keeps
        them), for tests that compare them with the actor's."""
        return {name: target.detach().clone() for name, (target, _) in self.llm.model.weight_targets().items()}
