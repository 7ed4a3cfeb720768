"""Weights into the engine's model: a Hugging Face directory read as (name, tensor) pairs, and
those pairs copied into the model's existing storage (full tensors, or this rank's shard).

    load_model(model, safetensors_weights(path))   # what LLM.from_pretrained does
    load_model(model, named_tensors)               # any source: a state dict, a weight sync

The directory's other files the engine reads (its stop ids, its tokenizer) are here too.
"""
from __future__ import annotations

import glob
import os
from collections.abc import Iterable, Iterator

import torch
from safetensors import safe_open

from hflow.engine.models.layers import TPInfo
from hflow.engine.models.llama import CausalLM
from hflow.validation import read_json_object


def safetensors_files(path: str) -> list[str]:
    """The weight files of a directory: those model.safetensors.index.json names, else
    model.safetensors, else every *.safetensors in it, sorted (a single file of another name).
    Raises FileNotFoundError when there are none."""
    index = os.path.join(path, "model.safetensors.index.json")
    single = os.path.join(path, "model.safetensors")
    if os.path.exists(index):
        weight_map = read_json_object(index).get("weight_map") or {}
        files = [os.path.join(path, f) for f in sorted(set(weight_map.values()))]
    elif os.path.exists(single):   # not a PEFT adapter_model.safetensors saved beside it
        files = [single]
    else:
        files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"{path}: no model.safetensors or model.safetensors.index.json "
                                "(only safetensors checkpoints are supported)")
    return files


def safetensors_weights(path: str) -> Iterator[tuple[str, torch.Tensor]]:
    """(Hugging Face name, tensor) of every weight in a directory, one tensor in memory at a
    time. The files are listed (and their absence raised) at the call, not at the first item."""
    return _read(safetensors_files(path))


def _read(files: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
    for file in files:
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


@torch.no_grad()
def load_model(model: CausalLM, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
    """Copy Hugging Face-named tensors into `model`'s parameter storage (no reallocation); each
    tensor is the full one (this rank of model.tp slices its part) or this rank's shard
    (LLM.load_weights says which). Rotary inverse frequencies are skipped; a name the model lacks is a KeyError,
    a shape that is neither a ValueError. Returns the names loaded."""
    targets, loaded = model.weight_targets(), set()
    # a family that stores a weight in another shape than Hugging Face's (Qwen3-MoE's fused
    # experts) says how to view the incoming tensor
    as_stored = getattr(model, "as_stored", lambda name, tensor: tensor)
    for name, tensor in named_tensors:
        if name.endswith("rotary_emb.inv_freq"):
            continue
        if name not in targets:
            raise KeyError(f"load_weights: unexpected weight {name!r} for model_type "
                           f"{model.config.model_type!r}")
        target, shard_dim = targets[name]
        _copy(name, target, as_stored(name, tensor), shard_dim, model.tp)
        loaded.add(name)
    return loaded


def unfilled_parameters(model: CausalLM, loaded: set[str]) -> list[str]:
    """The parameters of `model` whose storage no loaded name wrote to: what a checkpoint left
    as the engine allocated it (uninitialised memory). A tied head counts as filled through its
    embedding, a family's fused experts through their per-expert names (views of one storage)."""
    targets = model.weight_targets()
    filled = {targets[name][0].untyped_storage().data_ptr() for name in loaded}
    return [name for name, p in model.named_parameters() if p.untyped_storage().data_ptr() not in filled]


def _copy(name: str, target: torch.Tensor, tensor: torch.Tensor, shard_dim: int | None, tp: TPInfo) -> None:
    if tuple(tensor.shape) == tuple(target.shape):
        target.copy_(tensor)
        return
    if shard_dim is not None and tp.size > 1:
        full = list(target.shape)
        full[shard_dim] *= tp.size
        if list(tensor.shape) == full:
            n = target.shape[shard_dim]
            target.copy_(tensor.narrow(shard_dim, tp.rank * n, n))
            return
    expected = f"{tuple(target.shape)}"
    if shard_dim is not None and tp.size > 1:
        expected += f" (this rank's shard) or {tuple(full)} (full)"
    raise ValueError(f"load_weights: {name} has shape {tuple(tensor.shape)}, expected {expected}")


def stop_token_ids(model_path: str) -> list[int]:
    """The ids a response stops at: the generation config's EOS, else the model config's."""
    for name in ("generation_config.json", "config.json"):
        path = os.path.join(model_path, name)
        if not os.path.exists(path):
            continue
        eos = read_json_object(path).get("eos_token_id")
        if eos is not None:
            return [eos] if isinstance(eos, int) else list(eos)
    return []


def saved_tokenizer(path: str):
    """The tokenizer saved in a directory, or None: only a saved one (transformers would build
    an empty one from config.json alone)."""
    if not any(os.path.exists(os.path.join(path, f)) for f in ("tokenizer.json", "tokenizer_config.json")):
        return None
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(path)
