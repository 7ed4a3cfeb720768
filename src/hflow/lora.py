"""LoRA (Hu et al. 2021): train a low-rank update of the attention and MLP projections, the base frozen.

A target linear y = W x keeps its weight under its Hugging Face name and gains two parameters
beside it, `lora_A` [r, in] and `lora_B` [out, r]:

    y = W x + (alpha / r) · B A x        A ~ Kaiming-uniform (as PEFT), B = 0: the model starts as the base

Only A and B are trained, so the optimizer holds state for them alone and a checkpoint need hold
nothing else; the frozen base is stored in the compute dtype (hflow.workers.fsdp.storage_dtype).
The adapters live inside the decoder layers, so FSDP2 shards and gathers them with the layer. The
generation engine never sees them: it is given merged weights W + (alpha / r) · B A, each rank
its tensor-parallel slice (`merged_shard`); an export is merged too, or written as a PEFT adapter
directory (`peft_adapter_files`) that `peft.PeftModel.from_pretrained` loads on the base.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ADAPTER_NAMES = ("lora_A", "lora_B")


@dataclass
class LoRAConfig:
    """Low-rank adapters on the policy's projections (--actor.lora.*)."""

    rank: int = 0
    """r, the rank of each adapter (0: off, every weight is trained)."""
    alpha: float = 16.0
    """The update is scaled by alpha / r."""
    targets: tuple[str, ...] = field(default_factory=lambda: LORA_TARGETS)
    """The linear layers that get an adapter, by their last name."""

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank


def is_adapter(name: str) -> bool:
    """Whether a parameter name is an adapter's (lora_A / lora_B)."""
    return name.rsplit(".", 1)[-1] in ADAPTER_NAMES


def add_adapters(model: nn.Module, cfg: LoRAConfig) -> list[str]:
    """Give every target linear of `model` (on any device, the meta device included) an adapter:
    fp32 `lora_A`, `lora_B` trained, every other parameter frozen. Returns the adapted modules'
    names; none is an error that names the targets."""
    adapted = []
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and name.rsplit(".", 1)[-1] in cfg.targets:
            device = module.weight.device
            module.lora_A = nn.Parameter(torch.empty(cfg.rank, module.in_features, device=device))
            module.lora_B = nn.Parameter(torch.empty(module.out_features, cfg.rank, device=device))
            module.lora_scaling = cfg.scaling
            module.register_forward_hook(_add_low_rank_update)
            adapted.append(name)
    if not adapted:
        raise ValueError(f"--actor.lora.targets {' '.join(cfg.targets)}: no linear layer of the model has "
                         f"such a name (the usual ones: {' '.join(LORA_TARGETS)})")
    for name, param in model.named_parameters():
        param.requires_grad_(is_adapter(name))
    return adapted


def _add_low_rank_update(module: nn.Linear, args, output: torch.Tensor) -> torch.Tensor:
    x = args[0]
    return output + F.linear(F.linear(x, module.lora_A), module.lora_B) * module.lora_scaling


@torch.no_grad()
def init_adapters(model: nn.Module, seed: int, local_slices) -> None:
    """A from Kaiming-uniform (a = sqrt 5, PEFT's), B = 0, the same values on every rank: each full
    A is drawn from `seed` and this rank keeps its shard (`local_slices(param)`, hflow.workers)."""
    generator = torch.Generator().manual_seed(seed)
    for name, param in model.named_parameters():
        if not is_adapter(name):
            continue
        full = torch.zeros(param.shape)
        if name.endswith("lora_A"):
            bound = 1 / math.sqrt(param.shape[1])   # kaiming_uniform_(a=sqrt(5)) on [r, in]
            full.uniform_(-bound, bound, generator=generator)
        local = param.to_local() if hasattr(param, "to_local") else param
        local.copy_(full[local_slices(param)])


def low_rank_delta(lora_a: torch.Tensor, lora_b: torch.Tensor, scaling: float) -> torch.Tensor:
    """(alpha / r) · B A [out, in], in fp32."""
    return (lora_b.float() @ lora_a.float()) * scaling


def adapted_weights(model: nn.Module) -> dict[str, nn.Module]:
    """{name of a target's weight: its module}, for the adapted linears of `model`."""
    return {f"{name}.weight": module for name, module in model.named_modules() if hasattr(module, "lora_A")}


def merge_state_dict(state: dict[str, torch.Tensor], scaling: float) -> dict[str, torch.Tensor]:
    """A full state dict with adapters -> the plain model's: each target weight W + (alpha / r) · B A
    (in W's dtype), the adapters dropped."""
    merged = {k: v for k, v in state.items() if not is_adapter(k)}
    for key in [k for k in state if k.endswith(".lora_A")]:
        owner = key[: -len(".lora_A")]
        weight = merged[f"{owner}.weight"]
        merged[f"{owner}.weight"] = (weight.float() + low_rank_delta(state[key], state[f"{owner}.lora_B"],
                                                                     scaling)).to(weight.dtype)
    return merged


def peft_adapter_files(state: dict[str, torch.Tensor], cfg: LoRAConfig, base_model: str) -> tuple[dict, dict]:
    """(adapter_config.json, the adapter_model.safetensors tensors) of a PEFT LoRA adapter
    directory for a full state dict with adapters: PEFT's names wrap the model's as
    base_model.model.<name>.lora_A.weight."""
    tensors = {f"base_model.model.{k}.weight": v.contiguous() for k, v in state.items() if is_adapter(k)}
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": cfg.rank, "lora_alpha": cfg.alpha,
              "target_modules": sorted(cfg.targets), "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False,
              "use_rslora": False, "init_lora_weights": True, "modules_to_save": None,
              "base_model_name_or_path": base_model, "inference_mode": True}
    return config, tensors
