"""The optimizer of a trained worker: AdamW with warm-up and a constant or cosine schedule,
global-norm gradient clipping over sharded parameters, and the small sum the loss weights and
metrics of a step are reduced with."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterator, Literal

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from hflow.distributed.parallel import device_of


@dataclass
class OptimConfig:
    """AdamW, learning-rate schedule and gradient clipping."""

    lr: float = 1e-6
    """peak learning rate"""
    weight_decay: float = 0.0
    """AdamW decoupled weight decay"""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW (beta1, beta2)"""
    eps: float = 1e-8
    """AdamW epsilon"""
    schedule: Literal["constant", "cosine"] = "constant"
    """learning-rate schedule after the warm-up: constant, or cosine down to min_lr_ratio * lr"""
    warmup_steps: int = 0
    """optimizer steps of linear warm-up from lr / warmup_steps to lr"""
    total_steps: int = 0
    """optimizer steps the cosine schedule spans (required for cosine)"""
    min_lr_ratio: float = 0.0
    """final learning rate of the cosine schedule, as a fraction of lr"""
    grad_clip: float = 1.0
    """clip gradients to this global L2 norm (0: no clipping, the norm is still reported)"""


def build_optimizer(model: nn.Module, cfg: OptimConfig):
    """AdamW and a LambdaLR schedule: linear warm-up, then constant or cosine.

    lr(step) = lr * (step + 1) / warmup               for step < warmup
             = lr                                     (constant)
             = lr * (m + (1 - m) * (1 + cos(pi * p)) / 2),  p = (step - warmup) / (total - warmup)
    """
    params = [p for p in model.parameters() if p.requires_grad]
    # fused: one kernel per parameter instead of ~10 ops (CPU: 6x faster on the 25M model's shards)
    optimizer = torch.optim.AdamW(params, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps,
                                  weight_decay=cfg.weight_decay, fused=True)
    if cfg.schedule == "cosine" and cfg.total_steps <= cfg.warmup_steps:
        raise ValueError(f"--optim.schedule cosine needs --optim.total-steps ({cfg.total_steps}) "
                         f"> --optim.warmup-steps ({cfg.warmup_steps})")

    def factor(step: int) -> float:
        if step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        if cfg.schedule == "constant":
            return 1.0
        progress = min(1.0, (step - cfg.warmup_steps) / (cfg.total_steps - cfg.warmup_steps))
        return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def apply_optim_config(optimizer, scheduler, cfg: OptimConfig) -> dict[str, tuple]:
    """Make a resumed optimizer follow `cfg` (the flags of this run) rather than the run that
    saved it: the peak learning rate (the schedule's base, the step count kept), betas, eps and
    weight decay; the schedule's shape is the flags' already (it is code, not saved state).
    Returns what changed, name -> (the checkpoint's value, this run's)."""
    changed, wanted = {}, {"betas": tuple(cfg.betas), "eps": cfg.eps, "weight_decay": cfg.weight_decay}
    for i, group in enumerate(optimizer.param_groups):
        if scheduler.base_lrs[i] != cfg.lr:
            changed["lr"] = (scheduler.base_lrs[i], cfg.lr)
        scheduler.base_lrs[i] = group["initial_lr"] = cfg.lr
        for name, value in wanted.items():
            current = tuple(group[name]) if name == "betas" else group[name]
            if current != value:
                changed[name] = (current, value)
            group[name] = value
        group["lr"] = cfg.lr * scheduler.lr_lambdas[i](scheduler.last_epoch)
    scheduler._last_lr = [group["lr"] for group in optimizer.param_groups]   # what get_last_lr reports
    return changed


def clip_grad_norm_(params: Iterator[nn.Parameter], max_norm: float) -> torch.Tensor:
    """Global L2 norm of the gradients of (sharded) parameters; clip to `max_norm` if > 0.

    ||g|| = sqrt(sum_ranks sum_shard g^2): the norm of DTensor gradients is a partial DTensor,
    `full_tensor()` all-reduces it.
    """
    params = [p for p in params if p.grad is not None]
    norm = torch.nn.utils.get_total_norm([p.grad for p in params], norm_type=2.0)
    if isinstance(norm, DTensor):
        norm = norm.full_tensor()
    if max_norm > 0 and torch.isfinite(norm):
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
    return norm


def all_reduce_sum(values: torch.Tensor, mesh: DeviceMesh, op=dist.ReduceOp.SUM) -> torch.Tensor:
    """Sum (or reduce by `op`) a small float64 CPU tensor over the mesh (on the mesh's device,
    back to CPU)."""
    out = values.to(device_of(mesh), torch.float64)
    if mesh.size() > 1:
        dist.all_reduce(out, op=op, group=mesh.get_group())
    return out.cpu()
