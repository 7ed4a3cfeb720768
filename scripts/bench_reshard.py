"""Train -> generate resharding: time, bytes received and peak memory per rank, for each tp_g.

    torchrun --nproc-per-node 4 scripts/bench_reshard.py                      # 25M Qwen2, fp32
    torchrun --nproc-per-node 4 scripts/bench_reshard.py --hidden 64 --layers 2 --iters 2  # smoke

For every tensor-parallel size tp_g dividing the world, the FSDP2 actor's weights are streamed
into engine-like preallocated buffers (`reshard.generation_weights`), and compared with the naive
hand-over: a full all-gather of every parameter (`full_tensor()`). Printed per tp_g: the slowest
rank's time, the bytes one rank receives (as a fraction of the full all-gather's, in all and for
the tensor-parallel weights alone: embeddings, lm_head and norms are replicated), the peak
bytes allocated while resharding, and the largest layer's generation shard for comparison.
"""
import argparse
import os
import re
import shutil
import sys
import tempfile
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from hflow.distributed.byte_counters import AllocatedBytes, CollectiveBytes
from hflow.distributed.reshard import generation_mesh, generation_weights, tensor_parallel_dim
from hflow.workers import Actor, ActorConfig, FSDPConfig


def make_model(path: str, hidden: int, layers: int, vocab: int) -> None:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 11 // 4 // 8 * 8,
                         num_hidden_layers=layers, num_attention_heads=max(4, hidden // 64),
                         num_key_value_heads=max(2, hidden // 128), tie_word_embeddings=False)
    Qwen2ForCausalLM(config).save_pretrained(path)


def slowest(seconds: float) -> float:
    t = torch.tensor([seconds])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--iters", type=int, default=5)
    args = parser.parse_args()

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    tmp = [tempfile.mkdtemp() if rank == 0 else None]
    dist.broadcast_object_list(tmp)  # one directory for all ranks
    path = os.path.join(tmp[0], "model")
    if rank == 0:
        make_model(path, args.hidden, args.layers, args.vocab)
    dist.barrier()
    # sharded over every rank, as on GPUs (on CPU hflow replicates a model this small by default,
    # and then resharding moves nothing)
    actor = Actor(mesh, ActorConfig(model_path=path, fsdp=FSDPConfig(shard_size=world)))
    dist.barrier()
    if rank == 0:
        shutil.rmtree(tmp[0])
    params = dict(actor.model.named_parameters())
    model_bytes = sum(p.numel() * p.element_size() for p in params.values())
    full_gather = model_bytes * (world - 1) // world
    split_full = sum(p.numel() * p.element_size() for n, p in params.items()
                     if tensor_parallel_dim(n) is not None) * (world - 1) // world

    def naive():
        for p in params.values():
            p.full_tensor()

    start = time.perf_counter()
    for _ in range(args.iters):
        naive()
    naive_s = slowest((time.perf_counter() - start) / args.iters)
    if rank == 0:
        print(f"{world} ranks, {model_bytes / 2**20:.1f} MiB of fp32 weights; full all-gather: "
              f"{naive_s * 1e3:.1f} ms, {full_gather / 2**20:.2f} MiB received per rank")
        print(f"{'tp_g':>4} {'time ms':>8} {'MiB recv/rank':>14} {'of full':>8} {'tp-split':>11} {'peak MiB':>9} {'1 layer MiB':>12}")
    for tp in [t for t in (1, 2, 4, 8) if world % t == 0]:
        gen_mesh = generation_mesh(mesh, tp)
        engine = {name: shard.clone() for name, shard in generation_weights(actor.model, gen_mesh)}
        layers: dict[str, int] = {}
        for name, shard in engine.items():
            unit = re.match(r".*layers\.\d+\.", name)
            layers[unit.group(0) if unit else name] = layers.get(unit.group(0) if unit else name, 0) + shard.nbytes
        split_received = 0  # by the tensor-parallel (not replicated) weights
        with CollectiveBytes() as received, AllocatedBytes() as allocated:
            before = 0
            for name, shard in generation_weights(actor.model, gen_mesh):
                if tensor_parallel_dim(name) is not None:  # received while producing this shard
                    split_received += received.received - before
                before = received.received
                engine[name].copy_(shard)
                del shard
        start = time.perf_counter()
        for _ in range(args.iters):
            for name, shard in generation_weights(actor.model, gen_mesh):
                engine[name].copy_(shard)
                del shard
        seconds = slowest((time.perf_counter() - start) / args.iters)
        stats = torch.tensor([received.received, allocated.peak, split_received], dtype=torch.float64)
        dist.all_reduce(stats, op=dist.ReduceOp.MAX)
        if rank == 0:
            print(f"{tp:>4} {seconds * 1e3:>8.1f} {stats[0] / 2**20:>14.2f} {stats[0] / full_gather:>8.2f} "
                  f"{stats[2] / split_full:>11.2f} {stats[1] / 2**20:>9.2f} {max(layers.values()) / 2**20:>12.2f}")
    # Tearing down gloo sub-groups of a world-built DeviceMesh sometimes aborts a rank at
    # exit ("terminate called without an active exception"): leave once everyone is done.
    dist.barrier()
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
