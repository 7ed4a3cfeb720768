"""Rollouts from the actor's own ranks: the hybrid engine.

On `Actor.generate` the current FSDP2 weights go into a generation engine (hflow.engine) on the
same ranks through `reshard.generation_weights` — one tensor at a time, no second full copy of
the model — the engine generates, and goes back to sleep (KV cache and weights freed), so the
training step never sees it.

With tp_g > 1 the engine of a tensor-parallel group (ranks t * dp_g + j for t = 0..tp_g-1,
strided) runs as one: its ranks pool the prompts they were dispatched, generate them all with
the same seeds, and each keeps the results of its own prompts.

`with_greedy` adds one greedy (temperature 0) response per prompt to the same engine call — the
baseline of ReMax: row n of each prompt's n + 1 rows, flagged by the bool column `greedy`;
`split_greedy` separates the two.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from transformers import GenerationConfig

from hflow.batch import Batch
from hflow.engine import LLM, SamplingParams
from hflow.engine.sequence import RequestOutput
from hflow.parallel import make_mesh
from hflow.faults import fault_point
from hflow.reshard import generation_mesh, generation_weights
from hflow import layout
from hflow.workers.fsdp import device_of, mixed_precision


@dataclass
class RolloutConfig:
    """How the actor samples responses."""

    n: int = 1
    """samples per prompt"""
    temperature: float = 1.0
    """sampling temperature (0: greedy)"""
    top_p: float = 1.0
    """nucleus sampling threshold (1: off). Tokens come from the filtered distribution, their rollout log-probs from the unfiltered one, which actor.log_probs computes (hflow.engine.SamplingParams says why); keep 1 for RL"""
    top_k: int = 0
    """sample among the k likeliest tokens (0: off); log-probs as for top_p; keep 0 for RL"""
    max_tokens: int = 64
    """longest response, in tokens"""
    seed: int = 0
    """seed of the samples, the same on every rank (a recipe passes a new one each step, so that a resumed run draws what the uninterrupted run drew)"""
    tp_size: int = 1
    """tensor-parallel size of the generation engine (divides the actor's ranks)"""
    kv_cache_bytes: int = 0
    """KV cache budget per rank in bytes (0: the engine's default: 1 GiB at most on CPU, --rollout.gpu-memory-fraction on a GPU)"""
    gpu_memory_fraction: float = 0.9
    """on a GPU without --rollout.kv-cache-bytes: the share of the device's memory the engine may fill (training state, weights, KV cache and a step's activations together), measured before each rollout, as vLLM's gpu_memory_utilization"""
    max_num_seqs: int = 256
    """sequences decoded at once"""
    enable_prefix_caching: bool = True
    """the n samples of a prompt share its KV blocks"""
    max_model_len: int = 0
    """longest prompt + response the engine accepts (0: the model's max_position_embeddings)"""
    free_weights_when_asleep: bool = True
    """between rollouts, free the engine's weights too (they are reloaded from the actor each time)"""
    progress: bool = True
    """show a progress bar (on the actor's first rank)"""
    block_size: int = 16
    """tokens per KV-cache block"""


class Rollout:
    """The engine of one actor rank and the generation mesh it is fed through."""

    def __init__(self, train_mesh: DeviceMesh, model: torch.nn.Module, model_path: str, fsdp_cfg):
        self.train_mesh, self.model, self.model_path = train_mesh, model, model_path
        self.device = device_of(train_mesh)
        self.dtype = mixed_precision(fsdp_cfg, self.device).param_dtype or torch.float32
        self.llm = self.gen_mesh = None
        self.tp_size = 0

    def _engine(self, cfg: RolloutConfig):
        """Build the generation mesh and the engine the first time (and when tp_size changes)."""
        if self.llm is not None and cfg.tp_size == self.tp_size:
            return self.llm
        self.llm = None  # free the engine of another tp size first
        self.gen_mesh = generation_mesh(self.train_mesh, cfg.tp_size, make_mesh)
        options = {"max_num_seqs": cfg.max_num_seqs, "block_size": cfg.block_size,
                   "enable_prefix_caching": cfg.enable_prefix_caching,
                   "gpu_memory_fraction": cfg.gpu_memory_fraction}
        if cfg.kv_cache_bytes:
            options["kv_cache_bytes"] = cfg.kv_cache_bytes
        if cfg.max_model_len:
            options["max_model_len"] = cfg.max_model_len
        config = self.model.config
        self.llm = LLM.from_config(config, dtype=self.dtype, device=self.device,
                                   tp_group=self.gen_mesh.get_group("tp") if cfg.tp_size > 1 else None,
                                   eos_token_ids=_eos_ids(self.model_path, config), **options)
        self.tp_size = cfg.tp_size
        return self.llm

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], cfg: RolloutConfig, with_greedy: bool = False):
        """Sample `cfg.n` responses for each of this rank's prompts with the actor's current
        weights (and, `with_greedy`, a greedy one after them). Returns the engine's
        RequestOutputs, in prompt order."""
        llm = self._engine(cfg)
        llm.wake_up()
        fault_point("handoff")
        llm.load_weights(generation_weights(self.model, self.gen_mesh, self.dtype))
        # pool the prompts of the tp group: its engine runs them together
        tp_group = self.gen_mesh.get_group("tp")
        pooled = [None] * cfg.tp_size
        if cfg.tp_size > 1:
            dist.all_gather_object(pooled, prompts, group=tp_group)
        else:
            pooled = [prompts]
        params = SamplingParams(n=cfg.n, temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k,
                                max_tokens=cfg.max_tokens, seed=cfg.seed)
        show = cfg.progress and self.train_mesh.get_local_rank() == 0
        requests = [p for part in pooled for p in part]
        fault_point("generate")
        if with_greedy:
            # a request of its own next to the samples': it shares the prompt's KV blocks through the
            # prefix cache, and the samples' seeded streams do not change
            greedy = SamplingParams(n=1, temperature=0.0, max_tokens=cfg.max_tokens, seed=cfg.seed)
            outputs = llm.generate([p for p in requests for _ in range(2)], [params, greedy] * len(requests),
                                   use_tqdm=show)
            outputs = [_with_greedy(s, g) for s, g in zip(outputs[0::2], outputs[1::2])]
        else:
            outputs = llm.generate(requests, params, use_tqdm=show)
        llm.sleep(level=2 if cfg.free_weights_when_asleep else 1)
        mine = self.gen_mesh.get_local_rank("tp")
        start = sum(len(part) for part in pooled[:mine])
        return outputs[start:start + len(prompts)]


def _with_greedy(sampled: RequestOutput, greedy: RequestOutput) -> RequestOutput:
    """One prompt's samples, then its greedy completion as sample n."""
    last = replace(greedy.outputs[0], index=len(sampled.outputs))
    return RequestOutput(sampled.request_id, sampled.prompt_token_ids, [*sampled.outputs, last])


def _eos_ids(model_path: str, config) -> list[int] | None:
    if os.path.exists(os.path.join(model_path, "generation_config.json")):
        eos = GenerationConfig.from_pretrained(model_path).eos_token_id
        if eos is not None:
            return [eos] if isinstance(eos, int) else list(eos)
    return None


def prompt_token_lists(batch) -> list[list[int]]:
    """A prompts Batch's token ids: the `prompt_ids` column (lists of ids), or the real tokens of
    left-padded `input_ids` + `attention_mask`."""
    if "prompt_ids" in batch:
        return [list(map(int, ids)) for ids in batch["prompt_ids"]]
    ids, mask = batch["input_ids"], batch["attention_mask"].bool()
    return [row[m].tolist() for row, m in zip(ids, mask)]


def group_max(value: int, mesh: DeviceMesh) -> int:
    """The largest `value` over the mesh's ranks (so that every shard pads to the same width)."""
    t = torch.tensor([value], device=device_of(mesh))
    if mesh.size() > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=mesh.get_group())
    return int(t)


def rollout_batch(prompts_batch, prompts: list[list[int]], outputs, n: int, pad_id: int,
                  mesh: DeviceMesh, temperature: float, with_greedy: bool = False):
    """The engine's outputs as a Batch in the layout of hflow/layout.py, with the
    prompts' other columns repeated n times (n + 1 `with_greedy`, which adds the bool column
    `greedy`); widths agree over the mesh so that dp shards concatenate."""
    P = group_max(max(map(len, prompts), default=1), mesh)
    R = group_max(max((len(s.token_ids) for o in outputs for s in o.outputs), default=1), mesh)
    tensors, rows = layout.engine_outputs_to_tensors(prompts, outputs, pad_id, response_len=R, prompt_len=P)
    carried = prompts_batch.drop(*[k for k in ("prompt_ids", "input_ids", "attention_mask")
                                   if k in prompts_batch])
    per_prompt = n + with_greedy
    out = Batch({**tensors, **rows}, meta={**prompts_batch.meta, "n": per_prompt, "temperature": temperature})
    if with_greedy:
        out["greedy"] = (torch.arange(len(out)) % per_prompt) == n
    if len(carried.keys()):
        out = carried.repeat(per_prompt, interleave=True) | out
    return out


def split_greedy(batch: Batch) -> tuple[Batch, Batch]:
    """A rollout generated `with_greedy` -> (its sampled rows, meta n = samples per prompt;
    its greedy rows, one per prompt in prompt order, meta n = 1 and temperature 0)."""
    if "greedy" not in batch:
        raise KeyError("split_greedy: the batch has no `greedy` column; generate it with with_greedy=True")
    is_greedy = batch["greedy"]
    rows = batch.drop("greedy")
    sampled, greedy = rows[~is_greedy], rows[is_greedy]
    sampled.meta["n"] = batch.meta["n"] - 1
    greedy.meta.update(n=1, temperature=0.0)
    return sampled, greedy
