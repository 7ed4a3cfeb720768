"""A rollout's settings and its batches: RolloutConfig, the prompts' token ids, and the engine's
outputs as a Batch in the layout of hflow/layout.py. The engine that produces them is the
actor's hybrid engine (workers/hybrid_engine.py).

A rollout generated `with_greedy` holds one greedy (temperature 0) response per prompt besides
its samples — the baseline of ReMax: row n of each prompt's n + 1 rows, flagged by the bool
column `greedy`; `split_greedy` separates the two.
"""
from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from hflow import layout
from hflow.batch import Batch
from hflow.distributed.parallel import device_of
from hflow.workers.moe_replay import routes_in_layout


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

    def for_step(self, step: int, sampling_round: int = 0, rounds: int = 1) -> "RolloutConfig":
        """This config with the seed of step `step` (round `sampling_round` of `rounds` a step,
        DAPO's dynamic sampling): the one seed rule of every recipe, so that a resumed run draws
        what the uninterrupted run drew, on any number of ranks."""
        return dataclasses.replace(self, seed=self.seed + step * rounds + sampling_round)


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
    routes = routes_in_layout(outputs, P, R)
    if routes is not None:   # a MoE engine's experts, for routing replay (workers/moe_replay.py)
        tensors["routed_experts"] = routes
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


# how long a multi-turn rollout's loop waits for tool calls (or agents) before it looks again for
# weights a partial rollout was offered
OFFER_POLL_S = 0.05


def turn_seed(seed: int, row: int, sample: int, turn: int) -> int:
    """A multi-turn rollout's seed for one turn of one trajectory: by the global row, so that a
    trajectory does not depend on which rank ran it nor what decoded beside it."""
    digest = hashlib.sha256(f"hflow-agent-{seed}-{row}-{sample}-{turn}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 2
