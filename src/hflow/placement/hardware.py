"""Hardware profiles for the placement simulator: published specs for GPUs, a micro-benchmark
for this CPU.

    hw = PROFILES["a100"]                                  # DGX A100 80GB: 8 GPUs a node
    hw = dataclasses.replace(hw, memory=40 * GiB)          # what the CLI's flags override
    hw = cpu_profile(devices_per_node=4)                   # 4 ranks sharing this machine

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

import time
from dataclasses import dataclass, field

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


def _best_rate(work, amount: float, repeats: int = 5) -> float:
    work()                                         # warm-up: first-touch pages, pick kernels
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        work()
        best = min(best, time.perf_counter() - start)
    return amount / best


def cpu_profile(devices_per_node: int, memory: float | None = None) -> Hardware:
    """This machine as `devices_per_node` ranks sharing it (each gets that share of the cores'
    measured matmul rate and of the memory bandwidth). Measured: fp32 matmul FLOP/s (hflow
    runs fp32 on CPU) and memory bandwidth from a 256 MiB copy (read + write). Not measured:
    gloo's all-reduce between processes on one machine moves bytes through shared memory, so
    both "links" are estimated as the memory bandwidth, with a 50 us latency per collective
    (a loopback round trip). Memory: MemAvailable shared by the ranks, unless given."""
    import torch

    a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
    flops = _best_rate(lambda: torch.mm(a, b), 2 * 1024 ** 3)
    src = torch.empty(64 * 1024 ** 2)              # 256 MiB of fp32
    dst = torch.empty_like(src)
    bandwidth = _best_rate(lambda: dst.copy_(src), 2 * src.nbytes)
    if memory is None:
        with open("/proc/meminfo") as f:
            available = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable"))
        memory = available / devices_per_node
    share = bandwidth / devices_per_node
    return Hardware("cpu", memory=memory, peak_flops=flops / devices_per_node, memory_bandwidth=share,
                    nvlink_bandwidth=share, network_bandwidth=share, nvlink_latency=50e-6,
                    network_latency=50e-6, devices_per_node=devices_per_node, weight_bytes=4)
