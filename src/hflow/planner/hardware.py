"""Hardware profiles for the placement simulator: published specs for GPUs, a micro-benchmark
for this CPU.

    hw = PROFILES["a100"]                                  # DGX A100 80GB: 8 GPUs a node
    hw = dataclasses.replace(hw, memory=40 * GiB)          # what the CLI's flags override
    hw = cpu_profile(devices_per_node=4)                   # 4 ranks sharing this machine's cores

Bandwidths are per device and one direction: NVLink's "600 GB/s" (both directions) is 300 here;
the network figure is the device's share of its node's NICs (DGX A100: one 200 Gb/s HDR NIC per
GPU; DGX H100/H200: one 400 Gb/s NDR per GPU). Latency is what one collective costs before any
byte moves (llm-analysis' `intra_node_min_message_latency`, 8 us on A100/H100).

Efficiency: the fraction of a peak that real kernels reach, one per kind of work and the same
for every profile, model and placement (no per-case constants):
- train 0.5: Megatron-LM reaches 44-52 % of A100 bf16 peak on GPT models (Narayanan et al.,
  SC'21, Table 1); llm-analysis uses 0.5 for the same reason.
- inference 0.5: log-probs, values, scores and prefill run the same large GEMMs, forward only.
- generation 0.7: decode kernels (GEMV-shaped matmuls, paged attention) stream weights and KV
  at about 70 % of HBM bandwidth.
- communication 0.8: NCCL's all-reduce bus bandwidth on 8 A100 over NVLink is ~230 of 300 GB/s
  (nccl-tests); the same share is assumed of the network.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

from hflow.engine.config import DEFAULT_KV_CACHE_BYTES

GiB = 1024 ** 3
GB = 1e9


@dataclass(frozen=True)
class Efficiency:
    train: float = 0.5
    inference: float = 0.5
    generation: float = 0.7
    communication: float = 0.8


@dataclass(frozen=True)
class Hardware:
    name: str
    memory: float               # bytes per device
    peak_flops: float           # dense matmul FLOP/s in the compute dtype
    memory_bandwidth: float     # bytes/s, HBM (or DRAM) of one device
    nvlink_bandwidth: float     # bytes/s per device, one direction, inside a node
    network_bandwidth: float    # bytes/s per device, one direction, between nodes
    nvlink_latency: float       # seconds per collective inside a node
    network_latency: float      # seconds per collective between nodes
    devices_per_node: int
    weight_bytes: int = 2       # the compute dtype: bf16 on GPUs
    efficiency: Efficiency = field(default_factory=Efficiency)
    cores: int = 0              # ranks a node runs at full speed at once (0: each device is its own: GPUs)
    background: float = 0.0     # others' runnable processes sharing those cores (0: a dedicated machine)
    kv_cache_cap: float = 0.0   # bytes the engine's KV cache takes at most (0: what memory leaves, as on GPUs)

    def link(self, crosses_nodes: bool) -> tuple[float, float]:
        """(usable bytes/s, latency) of the slowest link a collective uses."""
        if crosses_nodes:
            return self.network_bandwidth * self.efficiency.communication, self.network_latency
        return self.nvlink_bandwidth * self.efficiency.communication, self.nvlink_latency


PROFILES = {
    # A100-SXM4-80GB: 312 TFLOP/s bf16 dense, 2.039 TB/s HBM2e, NVLink3 600 GB/s, HDR 200 Gb/s
    "a100": Hardware("a100", memory=80 * GiB, peak_flops=312e12, memory_bandwidth=2.039e12,
                     nvlink_bandwidth=300 * GB, network_bandwidth=25 * GB,
                     nvlink_latency=8e-6, network_latency=8e-6, devices_per_node=8),
    # H100-SXM5-80GB: 989 TFLOP/s bf16 dense, 3.35 TB/s HBM3, NVLink4 900 GB/s, NDR 400 Gb/s
    "h100": Hardware("h100", memory=80 * GiB, peak_flops=989e12, memory_bandwidth=3.35e12,
                     nvlink_bandwidth=450 * GB, network_bandwidth=50 * GB,
                     nvlink_latency=8e-6, network_latency=8e-6, devices_per_node=8),
    # H200-SXM-141GB: the H100's compute with 141 GB of HBM3e at 4.8 TB/s
    "h200": Hardware("h200", memory=141 * GB, peak_flops=989e12, memory_bandwidth=4.8e12,
                     nvlink_bandwidth=450 * GB, network_bandwidth=50 * GB,
                     nvlink_latency=8e-6, network_latency=8e-6, devices_per_node=8),
}


def _best_seconds(work, repeats: int = 5, before=None) -> float:
    work()                                         # warm-up: first-touch pages, pick kernels
    best = float("inf")
    for _ in range(repeats):
        if before is not None:
            before()
        start = time.perf_counter()
        work()
        best = min(best, time.perf_counter() - start)
    return best


def _best_rate(work, amount: float, repeats: int = 5) -> float:
    return amount / _best_seconds(work, repeats)


def _gloo_member(rank: int, rendezvous: str, sizes: list[int], results) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=2)
    seconds = []
    for nbytes in sizes:
        shard, full = torch.ones(nbytes // 8), torch.empty(nbytes // 4)
        seconds.append(_best_seconds(lambda: dist.all_gather_single(full, shard), repeats=100, before=dist.barrier))
    if rank == 0:
        results.put(seconds)
    dist.barrier()
    dist.destroy_process_group()


def gloo_link(small: int = 4096, large: int = 8 * 1024 ** 2) -> tuple[float, float]:
    """(bytes/s one rank receives, seconds per collective) of gloo between two processes of
    this machine: the best of 100 all-gathers of `small` bytes (the latency) and of `large`
    bytes (each rank receives half, the size of a small model's layer, as FSDP2 gathers
    them; the bandwidth is of the bytes beyond the small one's)."""
    import multiprocessing
    import tempfile

    context = multiprocessing.get_context("spawn")
    results = context.SimpleQueue()
    with tempfile.TemporaryDirectory() as tmp:
        members = [context.Process(target=_gloo_member, args=(r, f"{tmp}/rendezvous", [small, large], results))
                   for r in range(2)]
        for m in members:
            m.start()
        for m in members:
            m.join(timeout=120)
        if any(m.exitcode != 0 for m in members):
            for m in members:
                m.kill()
            raise RuntimeError("cpu_profile: the gloo measurement between two processes failed or hung (120 s)")
        latency, seconds = results.get()
    return (large - small) / 2 / max(seconds - latency, 1e-9), latency


def runnable_others(seconds: float = 1.0, samples: int = 20) -> float:
    """Processes of others that want a CPU right now: the kernel's count of runnable tasks
    (/proc/loadavg's 4th field), less this one, averaged over `seconds`. Unlike the load
    average, it does not remember a run that just ended."""
    counts = []
    for _ in range(samples):
        with open("/proc/loadavg") as f:
            counts.append(int(f.read().split()[3].split("/")[0]) - 1)
        time.sleep(seconds / samples)
    return sum(counts) / len(counts)


def cpu_profile(devices_per_node: int, memory: float | None = None, threads_per_rank: int | None = None,
                background: float = 0.0) -> Hardware:
    """This machine as `devices_per_node` ranks of `threads_per_rank` threads each (default:
    this process's torch threads; torchrun gives each rank 1), sharing its cores.

    Measured: one rank's fp32 matmul FLOP/s and memory bandwidth (a 256 MiB copy, read +
    write) with its threads alone on the machine, and gloo's all-gather between two processes
    (bandwidth and latency: gloo runs over loopback TCP here, both "links" are that). `cores`:
    how many ranks run at once at that speed (CPUs this process may use / threads a rank); the
    simulator lets a stage's concurrent ranks share them. Memory: MemAvailable shared by the
    ranks, unless given. `background`: others' runnable processes to plan for (0: the machine
    is the run's alone; `runnable_others()` measures it now). Numbers measured while others
    load the machine are low and noisy: note the load beside them."""
    import torch

    threads = threads_per_rank or torch.get_num_threads()
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        a, b = torch.randn(512, 512), torch.randn(512, 512)
        flops = _best_rate(lambda: torch.mm(a, b), 2 * 512 ** 3, repeats=20)
        src = torch.empty(64 * 1024 ** 2)              # 256 MiB of fp32
        dst = torch.empty_like(src)
        bandwidth = _best_rate(lambda: dst.copy_(src), 2 * src.nbytes)
    finally:
        torch.set_num_threads(saved)
    link, latency = gloo_link()
    if memory is None:
        with open("/proc/meminfo") as f:
            available = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable"))
        memory = available / devices_per_node
    cores = max(1, len(os.sched_getaffinity(0)) // threads)
    return Hardware("cpu", memory=memory, peak_flops=flops, memory_bandwidth=bandwidth,
                    nvlink_bandwidth=link, network_bandwidth=link, nvlink_latency=latency,
                    network_latency=latency, devices_per_node=devices_per_node, weight_bytes=4, cores=cores,
                    background=background, kv_cache_cap=DEFAULT_KV_CACHE_BYTES)   # the engine's cap on CPU
