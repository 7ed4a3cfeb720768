"""How many KV blocks the engine's cache holds (EngineConfig's num_kv_blocks / kv_cache_bytes /
gpu_memory_fraction describe the choice; config.py holds the formulas it is made of).

An explicit budget is taken as given. Without one, the cache holds what max_num_seqs sequences
of max_model_len need, capped on CPU at DEFAULT_KV_CACHE_BYTES and on a GPU by what fits in
gpu_memory_fraction of the device's memory beside what is in use and a step's activations,
measured each time the cache is to be allocated; the ranks of a tensor-parallel group take
the smallest of their budgets.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from hflow.engine.config import (DEFAULT_KV_CACHE_BYTES, EngineConfig, device_memory, kv_blocks_for_memory,
                                 step_activation_bytes)
from hflow.engine.model_runner import ModelRunner
from hflow.engine.models.llama import CausalLM


def sized_from_memory(model: CausalLM, cfg: EngineConfig) -> bool:
    """Whether the budget is measured from the device's free memory (at each allocation): on
    a GPU, without an explicit budget."""
    return cfg.num_kv_blocks is None and cfg.kv_cache_bytes is None and model.embed_tokens.weight.device.type != "cpu"


def num_kv_blocks(model: CausalLM, cfg: EngineConfig, max_model_len: int, from_memory: bool) -> int:
    """The KV blocks of `model`'s cache. `from_memory`: measure the device (sized_from_memory).
    Collective over model.tp when measured."""
    per_block = ModelRunner.bytes_per_block(model, cfg.block_size)
    wanted = cfg.max_num_seqs * -(-max_model_len // cfg.block_size)
    if cfg.num_kv_blocks is not None:
        num_blocks = cfg.num_kv_blocks
    elif cfg.kv_cache_bytes is not None:
        num_blocks = cfg.kv_cache_bytes // per_block
    elif not from_memory:
        num_blocks = min(wanted, DEFAULT_KV_CACHE_BYTES // per_block)
    else:
        device = model.embed_tokens.weight.device
        total, used = device_memory(device)
        elem = model.embed_tokens.weight.element_size()
        headroom = step_activation_bytes(model.config, cfg.max_num_batched_tokens, cfg.max_num_seqs, elem)
        # a step's gathers reuse a workspace of up to one layer's blocks (attention.py)
        per_block_used = per_block + per_block // len(model.layers)
        num_blocks = min(wanted, kv_blocks_for_memory(total, used, cfg.gpu_memory_fraction, per_block_used, headroom))
        if model.tp.size > 1:  # the ranks of a group must schedule alike: the smallest budget
            t = torch.tensor([num_blocks], device=device)
            dist.all_reduce(t, op=dist.ReduceOp.MIN, group=model.tp.group)
            num_blocks = int(t)
    if num_blocks < 1:
        raise ValueError(f"the KV budget holds no block of {per_block} bytes")
    return num_blocks


def worth_resizing(held: int, fits: int) -> bool:
    """Whether a cache budgeted at `held` blocks is rebuilt for `fits` measured now: to shrink
    always, to grow only for a real gain, more than 5 % (a new block manager costs ~1 us a block)."""
    return fits < held or fits > held * 1.05
