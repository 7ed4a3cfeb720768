"""FSDP2's collectives between the ranks of one CPU host: gloo against shared memory, side by side.

    torchrun --nproc-per-node 2 scripts/bench_collectives.py          # Qwen3-0.6B's layer sizes
    torchrun --nproc-per-node 2 scripts/bench_collectives.py --params 1000000 --reps 3   # smoke

At the sizes FSDP2 moves for one decoder layer of `--params` parameters (default Qwen3-0.6B's,
15.7M): the all-gather of the bf16 weights before a layer's forward and the reduce-scatter of
its fp32 gradients after its backward, each through gloo (`dist.all_gather_into_tensor`,
`dist.reduce_scatter_tensor`) and through hflow.distributed.cpu_collectives.HostSharedMemory, alternating,
one thread a rank, on the same buffers. Prints the median time of each, the ratio, the rate
(bytes each rank receives a second) and, as the floor, the time the copies alone would take at
this host's measured single-thread copy rate (the bytes a rank writes and reads through the
shared memory). Both results are checked against each other first.
"""
import argparse
import statistics
import time

import torch
import torch.distributed as dist

from hflow.distributed.cpu_collectives import HostSharedMemory


def median_seconds(fn, reps: int, group) -> float:
    fn()
    times = []
    for _ in range(reps):
        dist.barrier(group=group)
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    # the slowest rank's time is the collective's
    worst = torch.tensor(times, dtype=torch.float64)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX, group=group)
    return statistics.median(worst.tolist())


def copy_rate(nbytes: int) -> float:
    """Bytes a second one thread copies between two buffers of `nbytes` (read + write counted once)."""
    a, b = torch.empty(nbytes, dtype=torch.uint8), torch.empty(nbytes, dtype=torch.uint8)
    b.copy_(a)
    start = time.perf_counter()
    for _ in range(5):
        b.copy_(a)
    return 5 * nbytes / (time.perf_counter() - start)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", type=int, default=15_730_944, help="parameters of one layer (Qwen3-0.6B's)")
    ap.add_argument("--reps", type=int, default=10)
    args = ap.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    group = dist.new_group(list(range(dist.get_world_size())))
    world, rank = dist.get_world_size(), dist.get_rank()
    if not HostSharedMemory.on_one_host(group):
        raise SystemExit("the ranks are not on one host: nothing to compare")
    host = HostSharedMemory(group)
    n = args.params // world * world
    g = torch.Generator().manual_seed(rank)
    weights = torch.randn(n // world, generator=g).to(torch.bfloat16)
    grads = torch.randn(n, generator=g)
    gathered = [torch.empty(n, dtype=torch.bfloat16) for _ in range(2)]
    reduced = [torch.empty(n // world) for _ in range(2)]
    cases = {
        "all-gather, bf16 weights": (
            lambda: dist.all_gather_into_tensor(gathered[0], weights, group=group),
            lambda: host.all_gather(gathered[1], weights), gathered, weights.nbytes * (world - 1)),
        "reduce-scatter, fp32 grads": (
            lambda: dist.reduce_scatter_tensor(reduced[0], grads, group=group),
            lambda: host.reduce_scatter(reduced[1], grads), reduced, grads.nbytes * (world - 1) // world),
    }
    # what a rank copies through the shared memory: its part in, every part out (and for the
    # reduce-scatter, its shard of each rank's input read and the sum written)
    copied = {"all-gather, bf16 weights": weights.nbytes + world * weights.nbytes,
              "reduce-scatter, fp32 grads": grads.nbytes + grads.nbytes + grads.nbytes // world}
    rate = copy_rate(grads.nbytes)
    if rank == 0:
        print(f"{world} ranks x 1 thread, a layer of {n / 1e6:.1f}M parameters; one thread copies "
              f"{rate / 1e9:.1f} GB/s here")
        print(f"{'collective':<28}{'gloo ms':>10}{'shared ms':>11}{'ratio':>8}{'GB/s recv':>11}{'floor ms':>10}")
    for name, (gloo, shared, outs, received) in cases.items():
        gloo(), shared()
        if name.startswith("all-gather"):
            assert torch.equal(outs[0], outs[1]), name
        else:
            torch.testing.assert_close(outs[0], outs[1], rtol=1e-6, atol=1e-6)
        t_gloo = median_seconds(gloo, args.reps, group)
        t_shared = median_seconds(shared, args.reps, group)
        if rank == 0:
            print(f"{name:<28}{t_gloo * 1e3:10.1f}{t_shared * 1e3:11.1f}{t_gloo / t_shared:7.2f}x"
                  f"{received / t_shared / 1e9:11.1f}{copied[name] / rate * 1e3:10.1f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
