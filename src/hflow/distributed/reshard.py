"""Train -> generate resharding: FSDP2 weights into a tensor-parallel engine, layer by layer.

Training keeps every parameter as a DTensor sharded over the N ranks of a 1-D mesh: `Shard(0)`,
or `Shard(1)` for the row-parallel `o_proj`/`down_proj` (hflow/workers/fsdp.py). Generation
uses a 2-D mesh (tp, dp) over the same ranks, tp_g * dp_g = N, laid out as

    generation_mesh[t][j] = training_ranks[t * dp_g + j]

so the tensor-parallel groups (fixed j) are strided and the gather groups (fixed t) are
dp_g consecutive training shards. Training shard i = t * dp_g + j of a dim that divides by N is
then exactly block j of tp-block t: the local shard *is* a `(Shard(k), Shard(k))` DTensor on
the generation mesh, with no data movement. Redistributing it to `(Shard(d), Replicate())`

    d = 0  column-parallel weights and biases (q/k/v/gate/up): split by output rows
    d = 1  row-parallel weights (o_proj/down_proj): split by input columns
    -      norms, embeddings, lm_head: `(Replicate(), Replicate())`

all-gathers only inside the dp_g-rank groups when d == k — each rank receives (dp_g - 1) / N of
the tensor, 1/tp_g of a full all-gather — and is a no-op for tp_g = N. When d != k (a row-parallel
weight FSDP kept on dim 0), the rows are gathered in the dp group and then traded for columns in
one all-to-all across the tp group. A dim
that does not divide by N is chunked differently by nested and flat sharding (torch.chunk
rounds up), so such a tensor is gathered in full and sliced.

With HSDP (`--*.fsdp.shard-size` below N: the weights replicated over groups of consecutive
ranks, each sharded inside its group) a rank gathers the full tensor inside its shard group
and slices it: nothing moves when the groups are single ranks (replicated weights, the CPU
default), the full tensor's worth otherwise.

On CPU at tp_g = 1 with the ranks on one host, the all-gather goes through the shared memory
FSDP2's own collectives use there (hflow.distributed.cpu_collectives), not gloo.

Parameters are produced one at a time, in module order (layer by layer): the extra memory
in flight is one tensor's generation shard plus its communication buffers.
"""
from __future__ import annotations

from typing import Callable, Iterator, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from hflow import lora
from hflow.distributed.cpu_collectives import HostSharedMemory, host_shared_memory
from hflow.distributed.parallel import device_of, local_group

COLUMN_PARALLEL = ("q_proj.", "k_proj.", "v_proj.", "gate_proj.", "up_proj.")
ROW_PARALLEL = ("o_proj.weight", "down_proj.weight")


def tensor_parallel_dim(name: str) -> int | None:
    """The dim the engine's tensor parallelism splits `name` on; None when replicated."""
    if any(f".{p}" in name for p in COLUMN_PARALLEL):
        return 0
    if name.endswith(ROW_PARALLEL):
        return 1
    return None


def generation_rank_grid(ranks: Sequence[int], tp_size: int) -> list[list[int]]:
    """The (tp, dp) rank array of the generation mesh over the training ranks, in training order."""
    ranks = list(ranks)
    if tp_size < 1 or len(ranks) % tp_size:
        raise ValueError(f"--rollout.tp-size {tp_size} does not divide the actor's {len(ranks)} ranks")
    dp_size = len(ranks) // tp_size
    return [ranks[t * dp_size:(t + 1) * dp_size] for t in range(tp_size)]


def generation_mesh(train_mesh: DeviceMesh, tp_size: int,
                    make_mesh: Callable[[list[list[int]], tuple[str, str]], DeviceMesh] | None = None) -> DeviceMesh:
    """Build the (tp, dp) mesh over the training mesh's ranks. Creating process groups is
    collective: `make_mesh` (e.g. hflow.distributed.parallel.make_mesh) must be called on the right ranks;
    the default builds the DeviceMesh directly, which every rank of the world must call.

    At tp = 1 the dp dim is the training mesh's own group: a second group over the same ranks
    would be a second NCCL communicator (memory, start-up) for nothing."""
    grid = generation_rank_grid(train_mesh.mesh.flatten().tolist(), tp_size)
    if tp_size == 1 and train_mesh.ndim == 1:
        me = dist.get_rank()
        singleton = local_group([me]) if make_mesh is not None else \
            [dist.new_group([r]) for r in range(dist.get_world_size())][me]
        return DeviceMesh.from_group([singleton, train_mesh.get_group()], train_mesh.device_type,
                                     mesh=torch.tensor(grid), mesh_dim_names=("tp", "dp"))
    if make_mesh is not None:
        return make_mesh(grid, ("tp", "dp"))
    return DeviceMesh(train_mesh.device_type, torch.tensor(grid), mesh_dim_names=("tp", "dp"))


def generation_shard(param: DTensor, gen_mesh: DeviceMesh, dim: int | None,
                     dtype: torch.dtype | None = None) -> torch.Tensor:
    """This rank's generation shard of one FSDP2 parameter: chunk t (its tp index) of dim `dim`,
    or the full tensor when `dim` is None. May alias the training storage: copy it."""
    device = device_of(gen_mesh)
    local = param.to_local().to(device=device, dtype=dtype or param.dtype)  # cast before sending
    tp = gen_mesh.size(0)
    if dim is not None and param.shape[dim] % tp:
        raise ValueError(f"tensor-parallel size {tp} does not divide dim {dim} of a {tuple(param.shape)} weight")
    if param.device_mesh.ndim == 2:
        return _from_replicas(param, local, gen_mesh, dim, tp)
    (train_placement,) = param.placements
    k, world = train_placement.dim, gen_mesh.size()
    host = host_shared_memory(param.device_mesh.get_group(), create=False) if tp == 1 else None
    if host is not None and isinstance(train_placement, Shard) and param.shape[k] % world == 0:
        return _gathered_on_host(host, local, k)
    if dim is not None and param.shape[k] % world == 0:
        view = DTensor.from_local(local, gen_mesh, (Shard(k), Shard(k)), run_check=False,
                                  shape=param.shape, stride=param.stride())
        if dim == k or tp == 1 or (k, dim, param.ndim) != (0, 1, 2):
            return view.redistribute(gen_mesh, (Shard(dim), Replicate())).to_local()
        return _rows_to_columns(view.redistribute(gen_mesh, (Shard(0), Replicate())).to_local(), gen_mesh)
    # replicated, or not divisible by N: one all-gather over the training mesh (then slice)
    full = DTensor.from_local(local, param.device_mesh, param.placements, run_check=False,
                              shape=param.shape, stride=param.stride()).full_tensor()
    return full if dim is None else full.chunk(tp, dim)[gen_mesh.get_local_rank(0)]


def _gathered_on_host(host: HostSharedMemory, local: torch.Tensor, k: int) -> torch.Tensor:
    """The full tensor of even shards on dim `k`, all-gathered through the shared memory of the
    ranks' host (hflow.distributed.cpu_collectives; FSDP2's CPU set-up made it): what the redistribute
    below does over gloo at tp 1, in a fraction of the time."""
    parts = local.new_empty((host.world, *local.shape))
    host.all_gather(parts.view(-1), local.contiguous().view(-1))
    return parts.view(-1, *local.shape[1:]) if k == 0 else torch.cat(parts.unbind(0), dim=k)


def _from_replicas(param: DTensor, local: torch.Tensor, gen_mesh: DeviceMesh, dim: int | None, tp: int) -> torch.Tensor:
    """The generation shard of an HSDP parameter, `(Replicate(), Shard(k))` on a (replicate,
    shard) mesh: the full tensor is gathered inside the rank's shard group only (nothing
    moves when the shard groups are single ranks: each holds the whole tensor), then sliced."""
    if param.device_mesh.size(1) > 1:
        local = DTensor.from_local(local, param.device_mesh, param.placements, run_check=False,
                                   shape=param.shape, stride=param.stride()).full_tensor()
    return local if dim is None or tp == 1 else local.chunk(tp, dim)[gen_mesh.get_local_rank(0)]


def _rows_to_columns(rows: torch.Tensor, gen_mesh: DeviceMesh) -> torch.Tensor:
    """W[rows_t, :] on tp rank t -> W[:, cols_t], by one all-to-all in the tp group: rank t sends
    its block (rows_t, cols_u) to rank u and stacks what it receives in t order. DTensor would
    do this as all-to-all on NCCL but falls back to a full all-gather on gloo."""
    tp = gen_mesh.size(0)
    send = torch.cat(rows.chunk(tp, dim=1), dim=0)  # [S, C / tp]: block u holds columns u
    received = torch.empty_like(send)
    torch.distributed.all_to_all_single(received, send, group=gen_mesh.get_group(0))
    return received


def generation_weights(model: nn.Module, gen_mesh: DeviceMesh, dtype: torch.dtype | None = None,
                       tp_dim: Callable[[str], int | None] = tensor_parallel_dim
                       ) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (Hugging Face name, this rank's generation shard) for every parameter of an FSDP2
    model, one at a time. Every rank of the mesh must consume the whole iterator (collectives).
    A LoRA-adapted weight comes merged, W + (alpha / r) · B A (hflow.lora): the small A and B
    gathered in full, the product sliced like W; the adapters themselves are not yielded."""
    if hasattr(model, "reshard"):
        model.reshard()  # a root kept unsharded after forward would hold plain tensors
    adapted = lora.adapted_weights(model)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if lora.is_adapter(name):
                continue
            dim = tp_dim(name)
            # no local name holds a yielded tensor: the consumer's copy would otherwise stay alive
            # beside the next one, two tensors in flight instead of one
            if name in adapted:
                yield name, _merged(generation_shard(param, gen_mesh, dim, dtype), adapted[name], gen_mesh, dim)
            else:
                yield name, generation_shard(param, gen_mesh, dim, dtype)


def _merged(shard: torch.Tensor, module: nn.Module, gen_mesh: DeviceMesh, dim: int | None) -> torch.Tensor:
    full = [generation_shard(p, gen_mesh, None, torch.float32) for p in (module.lora_A, module.lora_B)]
    delta = lora.low_rank_delta(*full, module.lora_scaling)
    if dim is not None:
        delta = delta.chunk(gen_mesh.size(0), dim)[gen_mesh.get_local_rank(0)]
    return (shard.float() + delta).to(shard.dtype)
