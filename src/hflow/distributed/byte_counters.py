"""Measuring a rank: the bytes its collectives receive (gloo's, NCCL's, or through shared
memory), the bytes its ops allocate, and its peak memory.

    with CollectiveBytes() as moved:
        ...                                    # moved.received, moved.calls

Both are TorchDispatchModes: every op of the block passes through Python, so they cost time
and are for benchmarks and tests. `HFLOW_COUNT_COMM=1` makes every rank count what all its
worker calls receive (hflow.runtime.server); a trainable worker's `update` then reports the bytes
this rank received since its previous report as `comm/<role>_received_MiB`.
"""
from __future__ import annotations

import os
import resource
import weakref
from collections import defaultdict

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from hflow.distributed import cpu_collectives


def _group_size(boxed) -> int:
    return torch.distributed.ProcessGroup.unbox(boxed).size()


class CollectiveBytes(TorchDispatchMode):
    """Count the bytes this rank receives in collectives, as a ring or direct exchange moves
    them: an all-gather over g ranks receives the g - 1 pieces it lacks; a reduce-scatter
    receives (g - 1) / g of its input, an all-reduce twice that; an all-to-all all but its
    own 1/g of the output. Both the c10d ops (FSDP2, dist.*) and the functional ones (DTensor)."""

    def __init__(self):
        super().__init__()
        self.received = 0
        self.calls: dict[str, int] = defaultdict(int)

    def __enter__(self):
        # the collectives of ranks on one host run as copies through shared memory (hflow.distributed.cpu_collectives)
        cpu_collectives.RECEIVED_HOOKS.append(self._host)
        return super().__enter__()

    def __exit__(self, *exc):
        cpu_collectives.RECEIVED_HOOKS.remove(self._host)
        return super().__exit__(*exc)

    def _host(self, op: str, received: int) -> None:
        self.calls[op] += 1
        self.received += received

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        namespace, _, op = func._schema.name.partition("::")
        if namespace == "c10d":
            self._c10d(op, args)
        elif namespace == "_c10d_functional":
            self._functional(op, args, out)
        return out

    def _c10d(self, op: str, args) -> None:
        if op == "_allgather_base_":           # (output, input, group, ...)
            received = args[0].nbytes - args[1].nbytes
        elif op == "_reduce_scatter_base_":    # (output, input, group, ...)
            received = args[1].nbytes - args[0].nbytes
        elif op == "allreduce_":               # ([tensors], group, ...)
            g = _group_size(args[1])
            received = 2 * (g - 1) * sum(t.nbytes for t in args[0]) // g
        elif op == "alltoall_base_":           # (output, input, group, ...)
            received = args[0].nbytes - args[0].nbytes // _group_size(args[2])
        elif op == "allgather_":               # ([[outputs]], [inputs], group, ...)
            received = sum(t.nbytes for ts in args[0] for t in ts) - sum(t.nbytes for t in args[1])
        elif op == "broadcast_":               # ([tensors], group, root, ...)
            received = sum(t.nbytes for t in args[0])   # upper bound: the root receives nothing
        else:
            return
        self.calls[op] += 1
        self.received += received

    def _functional(self, op: str, args, out) -> None:
        self.calls[op] += 1
        if op == "all_gather_into_tensor":
            self.received += args[0].nbytes * (args[1] - 1)
        elif op == "all_to_all_single":
            group = torch.distributed.distributed_c10d._resolve_process_group(args[3])
            self.received += out.nbytes - out.nbytes // group.size()
        elif op in ("reduce_scatter_tensor", "all_reduce", "broadcast"):
            self.received += args[0].nbytes  # upper bound; not used by resharding


def counting_enabled() -> bool:
    return os.environ.get("HFLOW_COUNT_COMM", "") not in ("", "0")


# what every worker call of this process received, when counting_enabled() (hflow.runtime.server)
process_bytes = CollectiveBytes()
_reported = 0


def received_since_last_report() -> int:
    """Bytes this process's worker calls received since the previous call of this function."""
    global _reported
    new = process_bytes.received - _reported
    _reported = process_bytes.received
    return new
class AllocatedBytes(TorchDispatchMode):
    """Bytes of the tensor storages that ops create inside the block and that are still alive:
    `live` now, `peak` at most. Storages that existed before the block (inputs seen first) count
    0; a storage stops counting when it is freed, in whatever thread (gloo frees its buffers in
    its own). What ops allocate internally and free before returning is not seen."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0
        self._counted: dict[int, int] = {}  # storage address -> bytes counted for it

    def _see(self, tensor, new: bool) -> None:
        if type(tensor) is not torch.Tensor or tensor.device.type == "meta":
            return
        storage = tensor.untyped_storage()
        address = storage.data_ptr()
        if address in self._counted or storage.nbytes() == 0:
            return
        self._counted[address] = storage.nbytes() if new else 0
        self.live += self._counted[address]
        self.peak = max(self.peak, self.live)
        weakref.finalize(storage, self._freed, address)

    def _freed(self, address: int) -> None:
        self.live -= self._counted.pop(address, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        for t in tree_leaves((args, kwargs)):
            if isinstance(t, torch.Tensor):
                self._see(t, new=False)
        out = func(*args, **kwargs)
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._see(t, new=True)
        return out


def peak_memory_gib(device: torch.device) -> float:
    """This process's peak memory so far, GiB: the most CUDA memory its tensors held on a GPU
    (torch.cuda.max_memory_allocated), else its peak resident set (ru_maxrss, KiB on Linux):
    everything the process holds, so on colocated ranks the models it shares it with too."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
