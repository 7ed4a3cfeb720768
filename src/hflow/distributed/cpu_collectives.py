"""FSDP2's collectives on CPU: buffers handed out again, and ranks of one host talking through
shared memory instead of gloo's loopback TCP.

FSDP2 lets a model choose how its all-gathers and reduce-scatters are allocated and run
(`set_custom_all_gather` / `set_custom_reduce_scatter`); workers/fsdp.py installs these on CPU.
"""
from __future__ import annotations

import os
import socket
import uuid
import weakref
from typing import Callable

import torch
import torch.distributed as dist
from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather, DefaultReduceScatter

# What a CPU rank keeps of FSDP2's communication buffers between uses: a Qwen3-0.6B layer's
# gathered bf16 weights (31 MB) and fp32 gradients to reduce (63 MB on 2 ranks), a few of each.
REUSED_BUFFER_BYTES = 512 * 2**20

# Each rank's share of the shared memory of one group: two slots (a collective writes one while
# the other may still be read) of this many bytes; larger tensors go through in pieces.
SLOT_BYTES = 32 * 2**20

# told (op, bytes) of every collective run here, as c10d's ops are seen by a dispatch mode
# (hflow.distributed.byte_counters.CollectiveBytes): the bytes a rank received from the others
RECEIVED_HOOKS: list[Callable[[str, int], None]] = []


class ReusedBuffers:
    """FSDP2's all-gather outputs and reduce-scatter buffers, handed out again on CPU.

    Why: on CPU each of them is fresh memory from the kernel (glibc maps a block over 32 MiB
    anew and unmaps it when freed), so every layer's gather and every gradient reduction
    first-touched its pages: in one Qwen3-0.6B update (one process, 2 threads) the fp32 copies
    into the reduce-scatter inputs alone faulted in 1.2 GiB and took 2.0 s of 41. A GPU's
    caching allocator does this reuse already. Each caller gets a view of a kept buffer, and a
    buffer is handed out again only once no view of it is alive (FSDP's reference, an op in
    flight, a gradient that is a view of a reduction's output); at most `max_bytes` are kept,
    the rest allocated as before.

    With `host` (a HostSharedMemory of the group the model is sharded over), the collectives
    themselves run through it; else through the process group (gloo)."""

    def __init__(self, max_bytes: int, host: HostSharedMemory | None = None):
        self.max_bytes = max_bytes
        self.kept: list[torch.Tensor] = []
        pool = self

        class AllGather(DefaultAllGather):
            def allocate(self, size, *, dtype, device):
                return pool.allocate(size, dtype=dtype, device=device)

            def __call__(self, output_tensor, input_tensor, group, async_op=False):
                if host is None or not host.serves(group):
                    return super().__call__(output_tensor, input_tensor, group, async_op)
                host.all_gather(output_tensor, input_tensor)
                return None

        class ReduceScatter(DefaultReduceScatter):
            def allocate(self, size, *, dtype, device):
                return pool.allocate(size, dtype=dtype, device=device)

            def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
                if host is None or not host.serves(group) or op not in HostSharedMemory.OPS:
                    return super().__call__(output_tensor, input_tensor, group, op, async_op)
                host.reduce_scatter(output_tensor, input_tensor, op)
                return None

        self.all_gather, self.reduce_scatter = AllGather(), ReduceScatter()

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        shape = torch.Size(int(s) for s in size)
        for buffer in self.kept:
            if buffer.shape == shape and buffer.dtype == dtype and buffer.device == device and _unshared(buffer):
                # a view, never the kept tensor itself: holding the same tensor object would not
                # count as a holder of its storage, and the buffer would be handed out while in use
                return buffer.view(shape)
        buffer = torch.empty(shape, dtype=dtype, device=device)
        if sum(b.nbytes for b in self.kept) + buffer.nbytes <= self.max_bytes:
            self.kept.append(buffer)
            return buffer.view(shape)
        return buffer

    def release(self) -> None:
        """Stop keeping the buffers nothing else holds (between updates, when generation would
        have their memory). The next update allocates them again."""
        self.kept = [b for b in self.kept if not _unshared(b)]


def _unshared(buffer: torch.Tensor) -> bool:
    """Nothing holds `buffer`'s storage but `buffer` itself (2: its own reference and that of the
    Python storage object made to ask)."""
    return torch._C._storage_Use_Count(buffer.untyped_storage()._cdata) == 2


class HostSharedMemory:
    """All-gather and reduce-scatter between the ranks of a process group that all run on this
    host, through memory they share: each rank copies its part into its own slot, the group
    meets at a barrier (gloo's, so a dead rank times out as any collective does), and each rank
    reads what it needs from the others' slots. A reduce-scatter rank sums only its own shard,
    in rank order.

    Why: gloo sends a tensor between two processes of one host over loopback TCP, the kernel
    copying it twice and a gloo thread summing what arrives; here each byte is copied once each
    way by the ranks themselves.

    Two slots per rank, used in turn: a rank writes slot s again only two collectives later,
    after a barrier every other rank reached once done reading s. Each rank's slots are a file
    in /dev/shm whose pages are allocated at once (a /dev/shm too small, as Docker's default
    64 MB, fails here, on every rank alike, rather than with SIGBUS at a later write), that
    every rank maps, and that is unlinked as soon as they have. The group is held weakly: this
    object does not keep a destroyed process group alive."""

    OPS = (dist.ReduceOp.SUM, dist.ReduceOp.AVG)

    def __init__(self, group: dist.ProcessGroup, slot_bytes: int = SLOT_BYTES):
        self._group, self.slot_bytes = weakref.ref(group), slot_bytes
        self.world, self.rank = dist.get_world_size(group), dist.get_rank(group)
        path, size = f"/dev/shm/hflow-{uuid.uuid4().hex}", 2 * slot_bytes
        reserved = _reserve(path, size)
        everyone = [None] * self.world
        dist.all_gather_object(everyone, (reserved, path), group=group)
        if not all(ok for ok, _ in everyone):
            if reserved:
                os.unlink(path)
            raise OSError(f"/dev/shm could not hold {size / 2**20:.0f} MiB for each of "
                          f"{sum(not ok for ok, _ in everyone)} of the {self.world} ranks")
        self.regions = [torch.from_file(p, shared=True, size=size, dtype=torch.uint8) for _, p in everyone]
        dist.barrier(group=group)
        os.unlink(path)
        self.turn = 0

    @property
    def group(self) -> dist.ProcessGroup:
        group = self._group()
        if group is None:
            raise RuntimeError("the process group of this shared memory was destroyed")
        return group

    @staticmethod
    def on_one_host(group: dist.ProcessGroup) -> bool:
        """Whether every rank of `group` runs on this host (a collective over `group`)."""
        hosts = [None] * dist.get_world_size(group)
        dist.all_gather_object(hosts, socket.gethostname(), group=group)
        return len(set(hosts)) == 1

    def serves(self, group: dist.ProcessGroup) -> bool:
        return group is self._group()

    def _slot(self, rank: int, dtype: torch.dtype, turn: int) -> torch.Tensor:
        region = self.regions[rank][turn * self.slot_bytes:(turn + 1) * self.slot_bytes]
        return region.view(dtype)

    def _next_turn(self) -> int:
        turn, self.turn = self.turn, 1 - self.turn
        return turn

    def all_gather(self, output: torch.Tensor, input: torch.Tensor) -> None:
        """output = the ranks' inputs one after another (dist.all_gather_into_tensor)."""
        n = input.numel()
        piece = self.slot_bytes // input.element_size()
        out = output.view(self.world, n)
        for a in range(0, n, piece):
            b = min(n, a + piece)
            turn = self._next_turn()
            self._slot(self.rank, input.dtype, turn)[:b - a].copy_(input.view(-1)[a:b])
            dist.barrier(group=self.group)
            for r in range(self.world):
                out[r, a:b].copy_(self._slot(r, input.dtype, turn)[:b - a])
        for hook in RECEIVED_HOOKS:
            hook("host_all_gather", output.nbytes - input.nbytes)

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, op=dist.ReduceOp.SUM) -> None:
        """output = the sum (or mean) over ranks of their inputs' shard `rank`
        (dist.reduce_scatter_tensor)."""
        m = output.numel()
        rows = input.view(self.world, m)
        piece = self.slot_bytes // (self.world * input.element_size())
        for a in range(0, m, piece):
            b = min(m, a + piece)
            k, turn = b - a, self._next_turn()
            self._slot(self.rank, input.dtype, turn)[:self.world * k].view(self.world, k).copy_(rows[:, a:b])
            dist.barrier(group=self.group)
            parts = [self._slot(r, input.dtype, turn)[self.rank * k:(self.rank + 1) * k] for r in range(self.world)]
            out = output.view(-1)[a:b]
            torch.add(parts[0], parts[1], out=out)
            for part in parts[2:]:
                out.add_(part)
            if op == dist.ReduceOp.AVG:
                out.div_(self.world)
        for hook in RECEIVED_HOOKS:
            hook("host_reduce_scatter", input.nbytes - output.nbytes)


def _reserve(path: str, nbytes: int) -> bool:
    """Create `path` with `nbytes` of pages allocated now; False where it cannot be (no
    /dev/shm, or too little room in it)."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError:
        return False
    try:
        os.posix_fallocate(fd, 0, nbytes)
        return True
    except OSError:
        os.unlink(path)
        return False
    finally:
        os.close(fd)


# one per process group, dropped with it; None where shared memory does not apply
_HOST_MEMORY: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def host_shared_memory(group: dist.ProcessGroup, create: bool = True) -> HostSharedMemory | None:
    """The HostSharedMemory of `group` (made the first time: a collective over `group`), one
    per process group; None for a single rank, a group that spans hosts, or a /dev/shm that
    cannot hold it (gloo then). With `create` False, only one made before (by workers/fsdp.py's
    CPU set-up), else None."""
    if group not in _HOST_MEMORY and create:
        host = None
        if dist.get_world_size(group) > 1 and HostSharedMemory.on_one_host(group):
            try:
                host = HostSharedMemory(group)
            except OSError as e:
                if dist.get_rank(group) == 0:
                    print(f"hflow: {e}: FSDP's collectives on CPU go over gloo", flush=True)
        _HOST_MEMORY[group] = host
    return _HOST_MEMORY.get(group)
