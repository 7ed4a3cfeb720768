"""Hugging Face export: a trained model (FSDP2-sharded or not) as a directory that
`from_pretrained` loads. The directory is written as `<path>.partial` and renamed into place
whole: a run killed midway leaves no `path` that looks finished (an output directory's
`actor_hf` says the run ended)."""
from __future__ import annotations

import json
import os
import shutil
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from safetensors.torch import save_file
from transformers import AutoTokenizer
from transformers.utils import logging as hf_logging

from hflow import lora
from hflow.metrics import progress_enabled

from .dirs import fsync_dir


def _rank(group) -> int:
    return dist.get_rank(group) if dist.is_initialized() else 0


def _barrier(group):
    if dist.is_initialized():
        dist.barrier(group=group)


def export_hf(model, path, tokenizer=None, process_group=None) -> Path:
    """Write `model` (a transformers causal LM, FSDP2-sharded or not) as a Hugging Face
    directory: safetensors + config + generation config (+ tokenizer, an object or a directory
    to copy it from). Collective over the model's ranks; rank 0 of `process_group` writes.
    LoRA adapters (hflow.lora) are merged into their weights: the directory is a plain model.

    Parameters are gathered one at a time and moved to CPU on the writing rank only, so the
    extra accelerator memory is one full parameter. (`get_model_state_dict` with
    `full_state_dict=True, cpu_offload=True` would keep the tensors on *global* rank 0, which
    is not in the group when the actor does not live on rank 0.)
    """
    writer = _rank(process_group) == 0
    full = _gathered(model, writer)
    path = Path(path)
    if writer:
        scaling = next((m.lora_scaling for m in lora.adapted_weights(model).values()), None)
        with written_in_place(path) as partial:
            _save_pretrained(model, lora.merge_state_dict(full, scaling) if scaling else full, partial, tokenizer)
    _barrier(process_group)
    return path


def export_peft_adapter(model, path, cfg: lora.LoRAConfig, base_model: str, process_group=None) -> Path:
    """Write the LoRA adapters of `model` as a PEFT adapter directory (adapter_config.json,
    adapter_model.safetensors) that `peft.PeftModel.from_pretrained(<the base model>, path)`
    loads. Collective, like export_hf."""
    writer = _rank(process_group) == 0
    adapters = _gathered(model, writer, keep=lora.is_adapter)
    path = Path(path)
    if writer:
        with written_in_place(path) as partial:
            write_peft_adapter(partial, adapters, cfg, base_model)
    _barrier(process_group)
    return path


def write_peft_adapter(path: Path, state: dict, cfg: lora.LoRAConfig, base_model: str) -> None:
    """adapter_config.json and adapter_model.safetensors of `state`'s adapters in `path`."""
    config, tensors = lora.peft_adapter_files(state, cfg, base_model)
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, path / "adapter_model.safetensors")
    (path / "adapter_config.json").write_text(json.dumps(config, indent=2))


@contextmanager
def written_in_place(path):
    """A new directory to write `path`'s files into, renamed to `path` (replacing an earlier one)
    once the block ends and they are on disk; removed if the block raises. What a killed process
    leaves (`<path>.partial`) is cleared by the next export to `path`."""
    path = Path(path)
    partial = path.with_name(path.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    try:
        yield partial
        _sync_tree(partial)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    _replace_dir(partial, path)


def _sync_tree(path: Path) -> None:
    # transformers and safetensors do not fsync: the files must be on disk before the rename
    # that says they are complete
    for file in sorted(path.rglob("*"), reverse=True):
        if file.is_file():
            with open(file, "rb") as f:
                os.fsync(f.fileno())
        else:
            fsync_dir(file)
    fsync_dir(path)


def _replace_dir(new: Path, path: Path) -> None:
    # The earlier directory is moved aside, not removed first: until the second rename a crash
    # leaves it (as `<path>.replaced`) beside the complete new one, and nothing is lost.
    replaced = path.with_name(path.name + ".replaced")
    if path.exists():
        shutil.rmtree(replaced, ignore_errors=True)
        os.rename(path, replaced)
    os.rename(new, path)
    fsync_dir(path.parent)
    shutil.rmtree(replaced, ignore_errors=True)


def _gathered(model, writer: bool, keep=lambda name: True) -> dict[str, torch.Tensor]:
    """{name: full tensor on CPU} of the model's state (`keep` names only) on the writing rank,
    {} on the others; every rank takes part in each parameter's gather."""
    sharded = get_model_state_dict(model, options=StateDictOptions(full_state_dict=False))
    full = {}
    for name, tensor in sharded.items():
        if not keep(name):
            continue
        if isinstance(tensor, DTensor):
            tensor = tensor.full_tensor()      # collective over the parameter's mesh
        if writer:
            full[name] = tensor.detach().to("cpu", copy=True)
        del tensor
    return full


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
    if not progress_enabled():   # transformers' own "Writing model shards" bar follows hflow's switch
        hf_logging.disable_progress_bar()
    plain.save_pretrained(path, safe_serialization=True)
    if tokenizer is not None:
        if isinstance(tokenizer, (str, os.PathLike)):
            tokenizer = AutoTokenizer.from_pretrained(tokenizer)
        tokenizer.save_pretrained(path)
