"""FSDP2 set-up shared by every worker: dtypes, meta-device init, shard sizes, sharding.

A worker model is built (workers/hf_model.py) in torchtitan's order:

1. the `transformers` model with its parameters on the meta device (params_on_meta);
2. optional activation checkpointing (transformers' own flag, so parameter names stay the
   Hugging Face names that checkpoints, the engine and the resharding use);
3. `fully_shard` every decoder layer, then the root (shard_model), over groups of
   shard-size ranks (resolve_shard_size);
4. `to_empty` allocates only this rank's shards (materialize); each rank then copies from the
   safetensors files exactly the slice its DTensor shard covers, so no rank ever holds a full
   copy of the model.

Row-parallel weights (`o_proj`, `down_proj`) are sharded by FSDP on dim 1 (their input dim)
when it divides by the world size: the tensor-parallel engine splits them on dim 1 too, so
each rank's generation shard then *contains* its training shard and resharding needs only a
gather inside small groups (see hflow/distributed/reshard.py). The math of training does not change.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import Shard

from hflow.engine.models.layers import cpu_bf16_instructions  # the engine packs bf16 on the same test
from hflow.distributed.parallel import device_of, make_mesh
from hflow.distributed.reshard import ROW_PARALLEL  # the linears tensor parallelism splits on their input dim
from hflow.validation import ConfigError
from hflow.distributed.cpu_collectives import REUSED_BUFFER_BYTES, ReusedBuffers, host_shared_memory

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
           "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}


@dataclass
class FSDPConfig:
    """How a model is sharded, cast and offloaded."""

    param_dtype: str = "auto"
    """compute dtype of the unsharded parameters (fp32 master weights when trained): auto (bfloat16 on GPU; on CPU bfloat16 only with bf16 matmul instructions (AMX or AVX512-BF16) and a model of hidden size >= 1024, where it measured 2-11x fp32's matmuls, else float32: with neither, bf16 ran 65x slower), float32, bfloat16"""
    reduce_dtype: str = "float32"
    """dtype of the gradient reduction"""
    cpu_offload: bool = False
    """keep sharded parameters, gradients and optimizer state in CPU memory (GPU only)"""
    activation_checkpointing: bool = False
    """recompute each decoder layer's activations in the backward pass (SmolLM2-135M on 2 CPU ranks, sharded: 4.5 -> 3.2 GiB a rank, the update ~10 % slower; with --actor.fsdp.reshard-after-forward True 2.7 GiB, ~20 %: docs/real-model.md)"""
    reshard_after_forward: bool | None = None
    """free each layer's gathered parameters after its forward (False: keep them for the backward, one all-gather fewer per micro-batch, more memory; None: False on CPU, where memory is plentiful, True on GPUs)"""
    row_parallel_on_dim1: bool = True
    """shard o_proj/down_proj on their input dim, as tensor parallelism does (cheaper resharding)"""
    shard_size: int = 0
    """ranks each parameter is sharded over; the model is replicated over the groups of that many consecutive ranks and their gradients all-reduced between them (HSDP; verl's fsdp_size). 1: replicated on every rank, as DDP. 0: auto: all the ranks on GPUs; on CPU 1 when the host's ranks' full copies of the model's training state (16 bytes a parameter when trained, its weights when frozen) fit in a quarter of its memory, else all the ranks (on CPU a gloo all-gather costs more than the memory it saves)"""


# bf16 against fp32 matmuls (torch.mm, 2 threads, Qwen3-0.6B's shapes) on this project's 2-core
# CPUs: with AMX, 5-11x faster at 512-4096 rows (2-4x at decode's 32-64 rows); with AVX512-BF16
# (an AMD EPYC, 2026-12-04), 2.0-2.9x at 32-2048 rows; on an AVX2-only AMD EPYC, 1.9 against 126
# GFLOP/s (65x slower: oneDNN has no bf16 kernel there). Below this hidden size (the embedded
# default and the tests' models) fp32 stays the CPU's default, so that their results are the
# same on every CPU.
CPU_BF16_MIN_HIDDEN = 1024


def auto_param_dtype(device: torch.device, hidden_size: int | None = None) -> torch.dtype:
    """What --*.fsdp.param-dtype auto computes in: bf16 on GPUs; on CPU bf16 only where it was
    measured faster (bf16 instructions, and a model of hidden size >= CPU_BF16_MIN_HIDDEN), else fp32."""
    if device.type != "cpu":
        return torch.bfloat16
    fast = cpu_bf16_instructions() is not None and (hidden_size or 0) >= CPU_BF16_MIN_HIDDEN
    return torch.bfloat16 if fast else torch.float32


def resolve_param_dtype(cfg: FSDPConfig, device: torch.device, hidden_size: int, flag: str) -> FSDPConfig:
    """`cfg` with an auto compute dtype made concrete for a model of `hidden_size`, saying so
    where bf16 is chosen on a CPU, and warning where bf16 is asked for on a CPU without bf16 instructions."""
    if cfg.param_dtype == "auto":
        dtype = auto_param_dtype(device, hidden_size)
        if device.type == "cpu" and dtype == torch.bfloat16:
            print(f"hflow: {flag} auto: bfloat16 (this CPU has {cpu_bf16_instructions()}; hidden size {hidden_size} >= "
                  f"{CPU_BF16_MIN_HIDDEN}), fp32 master weights and reductions", flush=True)
        return dataclasses.replace(cfg, param_dtype=str(dtype).removeprefix("torch."))
    if device.type == "cpu" and _DTYPES[cfg.param_dtype] in (torch.bfloat16, torch.float16) and not cpu_bf16_instructions():
        print(f"hflow: warning: {flag} {cfg.param_dtype} on a CPU without bf16 instructions (AMX, AVX512-BF16) "
              f"({torch.backends.cpu.get_cpu_capability()}): its matmuls run far slower than fp32 here "
              "(65x on an AVX2 EPYC); drop the flag for fp32", flush=True)
    return cfg


def mixed_precision(cfg: FSDPConfig, device: torch.device) -> MixedPrecisionPolicy:
    """The compute dtype (auto: auto_param_dtype, for a model of unknown size) with the
    reduction in --*.fsdp.reduce-dtype (fp32)."""
    param_dtype = auto_param_dtype(device) if cfg.param_dtype == "auto" else _DTYPES[cfg.param_dtype]
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


def free_gathered_params(model: nn.Module) -> None:
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
        # transformers 5 renamed it (the old name warns); 4.x has only the old one
        if hasattr(model, "activation_checkpointing_enable"):
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
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
    if device.type == "cpu":
        group = mesh.get_group("shard") if mesh.ndim == 2 else mesh.get_group()
        buffers = ReusedBuffers(REUSED_BUFFER_BYTES, host_shared_memory(group))
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_custom_all_gather(buffers.all_gather)
                module.set_custom_reduce_scatter(buffers.reduce_scatter)
        model.reused_buffers = buffers
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
