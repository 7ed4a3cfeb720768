"""The worker side of the controller seam: this rank's device, the meshes worker code builds, and
giving the device's freed memory back (release_freed_memory).

`hflow.launch` sets the device once per rank; workers, the engine and the resharding read it
and build their own meshes here, so nothing under workers/ or engine/ imports the controller
(hflow.runtime.launcher).
"""
from __future__ import annotations

import ctypes
import threading

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch.distributed.device_mesh import DeviceMesh

_device: torch.device | None = None


def set_device(device: torch.device) -> None:
    """Called by hflow.launch before any worker exists."""
    global _device
    _device = device


def pick_device(wanted: str, local_rank: int, local_world_size: int, cuda_devices: int) -> torch.device:
    """This rank's device from HFLOW_DEVICE (`cpu`, `cuda`/`gpu`, or `cuda:N` for a lone
    process), LOCAL_RANK and the CUDA devices this process sees. One process per GPU: rank i
    of a host takes cuda:i; with one device visible per process (Slurm's --gpus-per-task,
    CUDA_VISIBLE_DEVICES set per rank) every rank takes cuda:0."""
    spelled = wanted.strip().lower()
    if spelled == "cpu":
        return torch.device("cpu")
    kind, _, index = spelled.partition(":")
    if kind not in ("cuda", "gpu") or (index and not index.isdigit()):
        raise ValueError(f"HFLOW_DEVICE={wanted!r}: use cpu, cuda (one GPU per process, by "
                         f"LOCAL_RANK) or cuda:N (a single process on GPU N)")
    if cuda_devices == 0:
        raise RuntimeError(f"HFLOW_DEVICE={wanted!r} but this process sees no CUDA device "
                           f"(CUDA_VISIBLE_DEVICES, the driver, or a CPU build of torch); "
                           f"set HFLOW_DEVICE=cpu to run on the CPU")
    if index:
        if local_world_size > 1:
            raise ValueError(f"HFLOW_DEVICE={wanted!r} pins every rank to one GPU; with "
                             f"{local_world_size} processes on this host use HFLOW_DEVICE=cuda")
        if int(index) >= cuda_devices:
            raise ValueError(f"HFLOW_DEVICE={wanted!r} but this process sees {cuda_devices} CUDA device(s)")
        return torch.device("cuda", int(index))
    if cuda_devices == 1:
        return torch.device("cuda", 0)
    if local_rank >= cuda_devices:
        raise RuntimeError(f"LOCAL_RANK {local_rank} but this process sees {cuda_devices} CUDA "
                           f"devices: start one process per GPU (torchrun --nproc-per-node), "
                           f"or set HFLOW_DEVICE=cpu")
    return torch.device("cuda", local_rank)


def current_device() -> torch.device:
    """This rank's device (cuda:LOCAL_RANK on GPUs, cpu otherwise), for worker code."""
    return _device if _device is not None else torch.device("cpu")


def device_of(mesh: DeviceMesh) -> torch.device:
    """This rank's device for tensors on `mesh`: the one `launch` set when the types agree,
    else the current CUDA device (`torch.cuda.current_device` exists in every torch hflow
    allows; `torch.accelerator.current_device_index` does not)."""
    if mesh.device_type == "cpu":
        return torch.device("cpu")
    device = current_device()
    if device.type == mesh.device_type and device.index is not None:
        return device
    return torch.device(mesh.device_type, torch.cuda.current_device())


def release_freed_memory(device: torch.device) -> bool:
    """Give the memory of freed tensors, which the allocator keeps for reuse, back to the
    system, so that the next phase can have it; returns whether there was a way to (False on a
    CPU whose C library has no malloc_trim: not glibc).

    On CUDA that is the caching allocator's cache (torch.cuda.empty_cache). On CPU, glibc's
    malloc: after the first large block is freed it raises its mmap threshold (up to 32 MiB),
    and from then on the blocks below it come from its heap, whose free pages it keeps
    resident; malloc_trim(0) returns every free page. Called when the engine goes to sleep:
    what it freed (weights, packed copies, KV cache) would otherwise stay resident through
    the update."""
    if device.type == "cuda":
        torch.cuda.empty_cache()
        return True
    if device.type != "cpu":
        return False
    trim = getattr(ctypes.CDLL(None), "malloc_trim", None)
    if trim is None:
        return False
    trim(0)
    return True


_local_meshes: dict[tuple, DeviceMesh] = {}
_local_group_counts: dict[tuple, int] = {}
_names_lock = threading.Lock()


def make_mesh(rank_array, dim_names) -> DeviceMesh:
    """A DeviceMesh over `rank_array` (nested list or tensor of global ranks, 1-D or n-D)
    built by those ranks alone: call it inside a worker method dispatched to exactly them
    (e.g. an actor building its tp_g x dp_g generation mesh over its own ranks) while other
    ranks do something else. Same arguments again return the same mesh."""
    array = torch.as_tensor(rank_array, dtype=torch.int64)
    dim_names = tuple(dim_names)
    if array.dim() != len(dim_names):
        raise ValueError(f"make_mesh: {array.dim()}-D rank array but dim names {dim_names}")
    key = (tuple(array.flatten().tolist()), tuple(array.shape), dim_names)
    if key in _local_meshes:
        return _local_meshes[key]
    me = dist.get_rank()
    where = (array == me).nonzero()
    if len(where) != 1:
        raise ValueError(f"make_mesh: rank {me} must appear once in {array.tolist()}")
    coordinate = where[0].tolist()
    groups = []
    for d in range(array.dim()):   # every member creates its groups in the same dim order
        index = list(coordinate)
        index[d] = slice(None)
        groups.append(local_group(array[tuple(index)].tolist()))
    mesh = DeviceMesh.from_group(groups if len(groups) > 1 else groups[0],
                                 current_device().type, mesh=array, mesh_dim_names=dim_names)
    _local_meshes[key] = mesh
    return mesh


def local_group(members: list[int]):
    """new_group(members) that only the members call.

    torch names such a group by hashing its ranks with the count of groups this process
    belongs to — and that count differs between ranks that belong to different groups, so the
    members would look for each other under different names and hang. We name it by its ranks
    and how many groups over exactly these ranks were made before: every member agrees.
    """
    key = tuple(members)
    with _names_lock:
        n = _local_group_counts.get(key, 0)
        _local_group_counts[key] = n + 1
        name = f"hflow_{'_'.join(map(str, key))}_{n}"
        original = c10d._hash_ranks_to_str
        c10d._hash_ranks_to_str = lambda ranks: name
        try:
            return dist.new_group(members, use_local_synchronization=True)
        finally:
            c10d._hash_ranks_to_str = original
