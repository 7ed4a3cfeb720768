"""A Hugging Face directory as a sharded worker model: build on the meta device, shard, then
fill each rank's shards from the safetensors files, reading only the slices it owns.

The steps and their order are in workers/fsdp.py; here: which transformers class (a causal LM,
a value model, a reward model), dropout off, a new head for a value or reward model started
from a causal LM, and the loading itself.
"""
from __future__ import annotations

import json
import os
import re
from contextlib import ExitStack
from typing import Callable

import torch
from safetensors import safe_open
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from transformers import (AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification,
                          AutoModelForTokenClassification)

from hflow.engine.loader import safetensors_files
from hflow.lora import LoRAConfig, add_adapters, init_adapters, is_adapter
from hflow.distributed.parallel import device_of
from hflow.workers.fsdp import FSDPConfig, materialize, params_on_meta, shard_model, storage_dtype
from hflow.workers.packing import register_attention


def build_model(path: str, mesh: DeviceMesh, cfg: FSDPConfig, kind: str = "causal_lm",
                trainable: bool = True, head_init_seed: int = 0, lora_cfg: LoRAConfig | None = None) -> nn.Module:
    """A sharded `transformers` model loaded from the Hugging Face directory `path`.

    kind: "causal_lm" (AutoModelForCausalLM), "value" (AutoModelForTokenClassification with one
    label: a scalar per token) or "reward" (AutoModelForSequenceClassification, one label).
    A "value" model built from a causal-LM checkpoint keeps the backbone and gets a new head,
    normal(0, initializer_range) from `head_init_seed` (the same on every rank). With
    `lora_cfg.rank` > 0 only LoRA adapters are trained (hflow.lora), on a frozen base stored in
    the compute dtype.
    """
    adapters = trainable and lora_cfg is not None and lora_cfg.rank > 0
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise FileNotFoundError(f"{path!r} is not a Hugging Face model directory (no config.json)")
    config = AutoConfig.from_pretrained(path)
    config.use_cache = False
    auto = {"causal_lm": AutoModelForCausalLM, "value": AutoModelForTokenClassification,
            "reward": AutoModelForSequenceClassification}[kind]
    if kind != "causal_lm":
        config.num_labels = 1
        config.classifier_dropout = 0.0   # unset, transformers' heads fall back to 0.1
    without_dropout(config)
    with params_on_meta():
        # every pass of a worker runs on packed sequences (hflow/workers/packing.py)
        model = auto.from_config(config, dtype=storage_dtype(cfg, device_of(mesh), trainable and not adapters),
                                 attn_implementation=register_attention())
    for module in model.modules():   # any dropout the config does not name
        if isinstance(module, nn.Dropout):
            module.p = 0.0
    model.requires_grad_(trainable)
    if kind == "causal_lm" and tied_plain_embedding(model):
        model.get_input_embeddings().register_forward_hook(_embedding_grad_into_head_grad)
    if adapters:   # before sharding: FSDP2 then shards each layer's adapters with it
        add_adapters(model, lora_cfg)
    shard_model(model, mesh, cfg)
    materialize(model, mesh, cfg)

    new_head = kind != "causal_lm" and _is_causal_lm_checkpoint(path)
    load_hf_weights(model, path, ignore=lambda k: new_head and k.startswith("lm_head."),
                    allow_missing=lambda n: (new_head and n.startswith("score.")) or (adapters and is_adapter(n)))
    if new_head:
        _init_head(model.score, config.initializer_range, head_init_seed)
    if kind == "value":
        # a Linear on [1, T, H] returns its [T, 1] product viewed as [1, T, 1]; FSDP2 warns of any
        # view the root returns (an in-place op on it would skip a hook), so the values are a copy
        model.score.register_forward_hook(_not_a_view)
    if adapters:
        init_adapters(model, head_init_seed, local_slices)
    if not trainable:
        model.eval()
    return model


def _not_a_view(module, args, output: torch.Tensor) -> torch.Tensor:
    return output.clone() if output._is_view() else output


def tied_plain_embedding(model: nn.Module) -> bool:
    """Whether the input embedding is a plain nn.Embedding (out = W[ids], no scale, norm or
    gradient rescaling) sharing its weight with the LM head."""
    emb, head = model.get_input_embeddings(), model.get_output_embeddings()
    return (type(emb) is nn.Embedding and head is not None and head.weight is emb.weight
            and emb.max_norm is None and not emb.scale_grad_by_freq and not emb.sparse)


def _embedding_grad_into_head_grad(module: nn.Embedding, args, output: torch.Tensor) -> torch.Tensor:
    """The lookup's gradient added in place, row by row, into the tied weight's gradient.

    Why: autograd's embedding backward builds a dense [vocab, hidden] zero gradient, fills in
    the rows looked up, and then adds it to the LM head's gradient out of place: two more
    [vocab, hidden] buffers (0.6 GB at Qwen3-0.6B in bf16, fresh pages on CPU) and two passes
    over them at the end of every backward. Here the lookup's output is cut from the weight and
    its gradient, when it arrives, goes into weight.grad at the rows looked up, summed per token
    in fp32 as autograd's CPU backward sums it. The head's part reaches weight.grad first (its
    backward runs before any layer's); if it has not, AccumulateGrad adds it to what is there."""
    weight = module.weight   # under FSDP2: the unsharded parameter the head's gradient goes to
    if not (torch.is_grad_enabled() and weight.requires_grad and args):   # ids by keyword: autograd's path
        return output
    ids = args[0].reshape(-1)
    lookup = output.detach().requires_grad_()

    def add_into_weight_grad(grad: torch.Tensor) -> None:
        rows = grad.reshape(-1, grad.shape[-1])
        if module.padding_idx is not None:   # the padding row gets no gradient (as nn.Embedding's)
            keep = ids != module.padding_idx
            rows, kept_ids = rows[keep], ids[keep]
        else:
            kept_ids = ids
        tokens, where = torch.unique(kept_ids, return_inverse=True)
        summed = torch.zeros(len(tokens), rows.shape[1], dtype=torch.float32, device=rows.device)
        summed.index_add_(0, where, rows.float())
        if weight.grad is None:
            weight.grad = torch.zeros_like(weight)
        weight.grad.index_add_(0, tokens, summed.to(weight.grad.dtype))

    lookup.register_hook(add_into_weight_grad)
    return lookup


def without_dropout(config) -> None:
    """Set every dropout probability of a transformers config to 0 (attention_dropout,
    hidden_dropout, resid_pdrop, embd_pdrop, classifier_dropout, ...).

    RL needs the training pass to compute the policy that sampled: with dropout on, the ratio
    pi/pi_old of the first on-policy step is not 1, and a value or reward model is noisy.
    """
    for name, value in vars(config).items():
        if ("dropout" in name or name.endswith("pdrop")) and isinstance(value, float):
            setattr(config, name, 0.0)


def _is_causal_lm_checkpoint(path: str) -> bool:
    with open(os.path.join(path, "config.json")) as f:
        archs = json.load(f).get("architectures") or []
    return any(a.endswith("ForCausalLM") for a in archs)


@torch.no_grad()
def _init_head(head: nn.Linear, std: float, seed: int) -> None:
    """Same values on every rank: draw the full (small) head, keep this rank's slice."""
    generator = torch.Generator().manual_seed(seed)
    for name, param in head.named_parameters():
        full = torch.zeros(param.shape) if name == "bias" else torch.randn(param.shape, generator=generator) * std
        local = param.to_local() if isinstance(param, DTensor) else param
        local.copy_(full[local_slices(param)])


def local_slices(param: torch.Tensor) -> tuple[slice, ...]:
    """The index of the full tensor that this rank's shard of `param` covers."""
    if not isinstance(param, DTensor):
        return tuple(slice(0, s) for s in param.shape)
    shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    return tuple(slice(o, o + s) for o, s in zip(offset, shape))


@torch.no_grad()
def load_hf_weights(model: nn.Module, path: str, ignore: Callable[[str], bool] = lambda name: False,
                    allow_missing: Callable[[str], bool] = lambda name: False) -> None:
    """Fill every (sharded) parameter from the safetensors files in `path`, reading only the
    slice this rank owns. Checkpoint keys for which `ignore(key)` holds are skipped; model
    parameters left unfilled are an error unless `allow_missing(name)`."""
    params = dict(model.named_parameters())  # tied weights appear once
    filled = set()
    for file in safetensors_files(path):
        with safe_open(file, framework="pt") as f:
            for key in f.keys():
                if ignore(key) or key not in params:
                    continue
                param, stored = params[key], f.get_slice(key)
                if list(stored.get_shape()) != list(param.shape):   # slicing would silently take a part
                    raise ValueError(f"{path}: {key} has shape {tuple(stored.get_shape())} in "
                                     f"{os.path.basename(file)} but {tuple(param.shape)} by config.json; "
                                     f"the config does not describe these weights")
                local = param.to_local() if isinstance(param, DTensor) else param
                if local.numel() > 0:
                    local.copy_(stored[local_slices(param)])
                filled.add(key)
    filled |= _load_per_expert_weights(params, path, filled)
    missing = [n for n in params if n not in filled and not allow_missing(n)]
    if missing:
        raise ValueError(f"{path}: the checkpoint has no weights for {missing[:8]}"
                         f"{' ...' if len(missing) > 8 else ''}")


# transformers 5 keeps a MoE's experts fused in memory (Qwen3-MoE: experts.gate_up_proj [E, 2I, H],
# experts.down_proj [E, H, I]) but save_pretrained writes one tensor per expert and projection
_PER_EXPERT = re.compile(r"(.+\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$")


def _load_per_expert_weights(params: dict[str, torch.Tensor], path: str, filled: set[str]) -> set[str]:
    """Fill the fused expert parameters not found under their own name from a checkpoint's
    per-expert tensors (`<prefix>.experts.{j}.{gate,up,down}_proj.weight`), reading only the
    experts of this rank's shard. Returns the names filled."""
    fused = {n: p for n, p in params.items() if n not in filled
             and n.endswith(("experts.gate_up_proj", "experts.down_proj"))}
    if not fused:
        return set()
    with ExitStack() as stack:
        where: dict[tuple[str, int, str], tuple] = {}   # (experts prefix, j, projection) -> (file, key)
        for file in safetensors_files(path):
            f = stack.enter_context(safe_open(file, framework="pt"))
            for key in f.keys():
                match = _PER_EXPERT.match(key)
                if match:
                    where[(match[1], int(match[2]), match[3])] = (f, key)
        done = set()
        for name, param in fused.items():
            prefix, kind = name.rsplit(".", 1)
            projections = ("gate", "up") if kind == "gate_up_proj" else ("down",)
            local = param.to_local() if isinstance(param, DTensor) else param
            index = local_slices(param)
            experts = range(param.shape[0])[index[0]]
            if any((prefix, j, proj) not in where for j in experts for proj in projections):
                continue   # reported as missing by the caller
            for row, j in enumerate(experts):
                full = torch.cat([where[(prefix, j, proj)][0].get_tensor(where[(prefix, j, proj)][1])
                                  for proj in projections])
                if tuple(full.shape) != tuple(param.shape[1:]):
                    raise ValueError(f"{path}: expert {j} of {name} has shape {tuple(full.shape)} in the "
                                     f"checkpoint but {tuple(param.shape[1:])} by config.json")
                local[row].copy_(full[index[1:]])
            done.add(name)
    return done
