"""FSDP2 set-up shared by every worker: build, shard, load, optimise.

The order is torchtitan's:

1. build the `transformers` model with its parameters on the meta device (see params_on_meta);
2. optional activation checkpointing (transformers' own flag, so parameter names stay the
   Hugging Face names that checkpoints, the engine and the resharding use);
3. `fully_shard` every decoder layer, then the root;
4. `to_empty` allocates only this rank's shards; each rank then copies from the safetensors
   files exactly the slice its DTensor shard covers (`safe_open(...).get_slice`), file by file,
   so no rank ever holds a full copy of the model.

Row-parallel weights (`o_proj`, `down_proj`) are sharded by FSDP on dim 1 (their input dim)
when it divides by the world size: the tensor-parallel engine splits them on dim 1 too, so
each rank's generation shard then *contains* its training shard and resharding needs only a
gather inside small groups (see hflow/reshard.py). The math of training does not change.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
from dataclasses import dataclass
from typing import Callable, Iterator, Literal

import torch
import torch.distributed as dist
from safetensors import safe_open
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from transformers import (AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification,
                          AutoModelForTokenClassification)

from hflow.parallel import device_of, make_mesh
from hflow.reshard import ROW_PARALLEL  # the linears tensor parallelism splits on their input dim
from hflow.validation import ConfigError
from hflow.workers.packing import register_attention

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
           "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}


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


@dataclass
class FSDPConfig:
    """How a model is sharded, cast and offloaded."""

    param_dtype: str = "auto"
    """compute dtype of the unsharded parameters: auto (bfloat16 on GPU, float32 on CPU), float32, bfloat16"""
    reduce_dtype: str = "float32"
    """dtype of the gradient reduction"""
    cpu_offload: bool = False
    """keep sharded parameters, gradients and optimizer state in CPU memory (GPU only)"""
    activation_checkpointing: bool = False
    """recompute each decoder layer's activations in the backward pass"""
    reshard_after_forward: bool | None = None
    """free each layer's gathered parameters after its forward (False: keep them for the backward, one all-gather fewer per micro-batch, more memory; None: False on CPU, where memory is plentiful, True on GPUs)"""
    row_parallel_on_dim1: bool = True
    """shard o_proj/down_proj on their input dim, as tensor parallelism does (cheaper resharding)"""
    shard_size: int = 0
    """ranks each parameter is sharded over; the model is replicated over the groups of that many consecutive ranks and their gradients all-reduced between them (HSDP; verl's fsdp_size). 1: replicated on every rank, as DDP. 0: auto: all the ranks on GPUs; on CPU 1 when the host's ranks' full copies of the model's training state (16 bytes a parameter when trained, its weights when frozen) fit in a quarter of its memory, else all the ranks (on CPU a gloo all-gather costs more than the memory it saves)"""


def mixed_precision(cfg: FSDPConfig, device: torch.device) -> MixedPrecisionPolicy:
    """bf16 compute with fp32 reduction on GPU; fp32 everywhere on CPU (no bf16 units there)."""
    if cfg.param_dtype == "auto":
        param_dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    else:
        param_dtype = _DTYPES[cfg.param_dtype]
    return MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=_DTYPES[cfg.reduce_dtype])


def storage_dtype(cfg: FSDPConfig, device: torch.device, trainable: bool) -> torch.dtype:
    """The dtype a model's sharded parameters are kept in: fp32 master weights for a model the
    optimizer updates; the compute dtype for a frozen one (reference, frozen reward model),
    which FSDP would otherwise cast on every forward from fp32 shards twice the size."""
    return torch.float32 if trainable else (mixed_precision(cfg, device).param_dtype or torch.float32)


@contextlib.contextmanager
def params_on_meta():
    """Parameters on the meta device, buffers for real.

    Each parameter is moved to meta as its module registers it, before the model's weight
    initialisation runs (on meta: free), so at most one never-touched parameter allocation
    exists at a time. Buffers such as the rotary `inv_freq` are computed in `__init__` and are
    not in checkpoints, so they stay real; parameters are filled from the checkpoint after
    sharding.
    """
    register = nn.Module.register_parameter

    def register_on_meta(module, name, param):
        register(module, name, param)
        if param is not None and param.device.type != "meta":
            module._parameters[name] = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)

    nn.Module.register_parameter = register_on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks of a transformers model (`model.model.layers` for the Llama family)."""
    base = getattr(model, getattr(model, "base_model_prefix", "model"), model)
    layers = getattr(base, "layers", None)
    if layers is None:
        raise ValueError(f"{type(model).__name__}: no decoder layers found at .{model.base_model_prefix}.layers")
    return list(layers)


def reshard(model: nn.Module) -> None:
    """Free every gathered parameter: with reshard_after_forward off, a forward without a
    backward leaves them gathered, and the engine and the optimizer must see the shards."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def host_memory_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def check_shard_size(shard_size: int, ranks: int, flag: str = "--fsdp.shard-size", owner: str = "model") -> None:
    """Refuse a shard size that is negative or does not divide the `ranks` of its `owner`."""
    if shard_size < 0:
        raise ConfigError(f"{flag} {shard_size}: must be >= 0 (0: auto, 1: replicated)")
    if shard_size and ranks % shard_size:
        raise ConfigError(f"{flag} {shard_size}: does not divide the {ranks} ranks of the {owner} "
                          f"(0: auto, 1: replicated)")


def replicas_fit(copies_bytes: float, memory_bytes: float) -> bool:
    """The CPU rule of auto shard size: every rank holds a whole model while all the host's
    copies of its training state take at most a quarter of the host's memory (the rest: the
    weights FSDP computes with, the engine's copy, the other models, activations). The
    placement planner prices runs by the same rule."""
    return copies_bytes <= memory_bytes / 4


def resolve_shard_size(cfg: FSDPConfig, world: int, device: torch.device, state_bytes: int,
                       host_bytes: int | None = None, ranks_on_host: int | None = None) -> int:
    """How many ranks each parameter is sharded over (FSDPConfig.shard_size; 0: auto).

    Auto on CPU weighs what sharding saves against what it costs there: a full copy of the
    training state on each of the host's ranks (`state_bytes` each) when they fit (replicas_fit),
    since gloo moves a tensor at ~1 GB/s and every training pass and every resharding for the
    engine would all-gather the weights."""
    check_shard_size(cfg.shard_size, world)
    if cfg.shard_size:
        return cfg.shard_size
    if device.type != "cpu":
        return world
    host = host_bytes if host_bytes is not None else host_memory_bytes()
    ranks = ranks_on_host if ranks_on_host is not None else int(os.environ.get("LOCAL_WORLD_SIZE", world))
    return 1 if replicas_fit(state_bytes * ranks, host) else world


def training_state_bytes(model: nn.Module) -> int:
    """Bytes of one full copy of a model's training state: for each trained parameter its
    fp32 weight, gradient and Adam's two moments; a frozen parameter's weight."""
    return sum(p.numel() * (16 if p.requires_grad else p.element_size()) for p in model.parameters())


def fsdp_mesh(mesh: DeviceMesh, shard_size: int) -> DeviceMesh:
    """The mesh `fully_shard` runs on: `mesh` itself when every rank shards, else a 2-D
    (replicate, shard) mesh over the same ranks, shard groups of consecutive ranks (HSDP)."""
    if shard_size == mesh.size():
        return mesh
    ranks = mesh.mesh.flatten().tolist()
    return make_mesh([ranks[i:i + shard_size] for i in range(0, len(ranks), shard_size)], ("replicate", "shard"))


def shard_model(model: nn.Module, mesh: DeviceMesh, cfg: FSDPConfig) -> nn.Module:
    """Activation checkpointing, then `fully_shard` per decoder layer and on the root, over
    groups of `cfg.shard_size` ranks (see resolve_shard_size)."""
    device = device_of(mesh)
    if cfg.activation_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    shard_size = resolve_shard_size(cfg, mesh.size(), device, training_state_bytes(model))
    mesh = fsdp_mesh(mesh, shard_size)
    row_parallel_ids = {id(p) for n, p in model.named_parameters() if n.endswith(ROW_PARALLEL)}

    def placement(param: nn.Parameter):
        # FSDP2 asks for an even split on any dim other than 0.
        if cfg.row_parallel_on_dim1 and id(param) in row_parallel_ids and param.shape[1] % shard_size == 0:
            return Shard(1)
        return None

    offload = CPUOffloadPolicy(pin_memory=device.type != "cpu") if cfg.cpu_offload and device.type != "cpu" \
        else OffloadPolicy()
    reshard_after_forward = device.type != "cpu" if cfg.reshard_after_forward is None else cfg.reshard_after_forward
    kwargs = dict(mesh=mesh, mp_policy=mixed_precision(cfg, device), offload_policy=offload,
                  shard_placement_fn=placement, reshard_after_forward=reshard_after_forward)
    for layer in decoder_layers(model):
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    return model


def materialize(model: nn.Module, mesh: DeviceMesh, cfg: FSDPConfig) -> None:
    """Allocate this rank's parameter shards (uninitialised) and put the real buffers back."""
    device = device_of(mesh)
    buffers = {name: buf for name, buf in model.named_buffers()}
    model.to_empty(device="cpu" if cfg.cpu_offload else device)
    for name, buf in buffers.items():
        owner_name, _, attr = name.rpartition(".")
        owner = model.get_submodule(owner_name) if owner_name else model
        owner._buffers[attr] = buf.to(device)


def checkpoint_files(path: str) -> list[str]:
    """The safetensors files of a Hugging Face directory: sharded with an index, or a single file."""
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(path, n) for n in names]
    single = os.path.join(path, "model.safetensors")
    if os.path.exists(single):
        return [single]
    raise FileNotFoundError(f"{path}: no model.safetensors or model.safetensors.index.json "
                            "(only safetensors checkpoints are supported)")


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
    for file in checkpoint_files(path):
        with safe_open(file, framework="pt") as f:
            for key in f.keys():
                if ignore(key) or key not in params:
                    continue
                param = params[key]
                local = param.to_local() if isinstance(param, DTensor) else param
                if local.numel() > 0:
                    local.copy_(f.get_slice(key)[local_slices(param)])
                filled.add(key)
    missing = [n for n in params if n not in filled and not allow_missing(n)]
    if missing:
        raise ValueError(f"{path}: the checkpoint has no weights for {missing[:8]}"
                         f"{' ...' if len(missing) > 8 else ''}")


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


def all_reduce_sum(values: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """Sum a small float64 CPU tensor over the mesh (on the mesh's device, back to CPU)."""
    out = values.to(device_of(mesh), torch.float64)
    if mesh.size() > 1:
        dist.all_reduce(out, group=mesh.get_group())
    return out.cpu()


def build_model(path: str, mesh: DeviceMesh, cfg: FSDPConfig, kind: str = "causal_lm",
                trainable: bool = True, head_init_seed: int = 0) -> nn.Module:
    """A sharded `transformers` model loaded from the Hugging Face directory `path`.

    kind: "causal_lm" (AutoModelForCausalLM), "value" (AutoModelForTokenClassification with one
    label: a scalar per token) or "reward" (AutoModelForSequenceClassification, one label).
    A "value" model built from a causal-LM checkpoint keeps the backbone and gets a new head,
    normal(0, initializer_range) from `head_init_seed` (the same on every rank).
    """
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
        model = auto.from_config(config, dtype=storage_dtype(cfg, device_of(mesh), trainable),
                                 attn_implementation=register_attention())
    for module in model.modules():   # any dropout the config does not name
        if isinstance(module, nn.Dropout):
            module.p = 0.0
    model.requires_grad_(trainable)
    shard_model(model, mesh, cfg)
    materialize(model, mesh, cfg)

    new_head = kind != "causal_lm" and _is_causal_lm_checkpoint(path)
    load_hf_weights(model, path, ignore=lambda k: new_head and k.startswith("lm_head."),
                    allow_missing=lambda n: new_head and n.startswith("score."))
    if new_head:
        _init_head(model.score, config.initializer_range, head_init_seed)
    if not trainable:
        model.eval()
    return model


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
