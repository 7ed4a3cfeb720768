"""Hugging Face export: a trained model (FSDP2-sharded or not) as a directory that
`from_pretrained` loads."""
from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from transformers import AutoTokenizer


def _rank(group) -> int:
    return dist.get_rank(group) if dist.is_initialized() else 0


def _barrier(group):
    if dist.is_initialized():
        dist.barrier(group=group)


def export_hf(model, path, tokenizer=None, process_group=None) -> Path:
    """Write `model` (a transformers causal LM, FSDP2-sharded or not) as a Hugging Face
    directory: safetensors + config + generation config (+ tokenizer, an object or a directory
    to copy it from). Collective over the model's ranks; rank 0 of `process_group` writes.

    Parameters are gathered one at a time and moved to CPU on the writing rank only, so the
    extra accelerator memory is one full parameter. (`get_model_state_dict` with
    `full_state_dict=True, cpu_offload=True` would keep the tensors on *global* rank 0, which
    is not in the group when the actor does not live on rank 0.)
    """
    writer = _rank(process_group) == 0
    sharded = get_model_state_dict(model, options=StateDictOptions(full_state_dict=False))
    full = {}
    for name, tensor in sharded.items():
        if isinstance(tensor, DTensor):
            tensor = tensor.full_tensor()      # collective over the parameter's mesh
        if writer:
            full[name] = tensor.detach().to("cpu", copy=True)
        del tensor
    path = Path(path)
    if writer:
        _save_pretrained(model, full, path, tokenizer)
    _barrier(process_group)
    return path


def _save_pretrained(model, state_dict: dict, path: Path, tokenizer):
    # fully_shard swaps the module's class for a subclass named FSDP<Class>; save_pretrained
    # would write that name into config.architectures. Rebuild the plain class on the meta
    # device and assign the gathered tensors to it instead.

    cls = next(c for c in type(model).__mro__ if not issubclass(c, FSDPModule))
    with torch.device("meta"):
        plain = cls(model.config)
    plain.load_state_dict(state_dict, strict=True, assign=True)
    if getattr(model.config, "tie_word_embeddings", False):
        plain.tie_weights()
    if getattr(model, "generation_config", None) is not None:
        plain.generation_config = model.generation_config
    path.mkdir(parents=True, exist_ok=True)
    plain.save_pretrained(path, safe_serialization=True)
    if tokenizer is not None:
        if isinstance(tokenizer, (str, os.PathLike)):
            tokenizer = AutoTokenizer.from_pretrained(tokenizer)
        tokenizer.save_pretrained(path)
