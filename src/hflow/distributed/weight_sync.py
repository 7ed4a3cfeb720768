"""The actor's weights pushed to a rollout group on other ranks: a bucketed broadcast.

    manifest = weight_manifest(model)                       # [(name, shape)], once
    send_weights(named_tensors, manifest, group, source)    # the actor's first rank
    llm.load_weights(receive_weights(manifest, dtype, device, group, source))   # every rollout rank

The actor's ranks gather each full tensor in the engine's dtype (hflow.distributed.reshard at tp 1, LoRA
merged); its first rank packs them, in manifest order, into flat buckets of at most
`bucket_bytes` (a tensor larger than that goes alone) and broadcasts each over a process group
that joins it to the rollout ranks (NCCL on GPUs, gloo on CPU). Both sides cut the manifest
into the same buckets, so nothing but the bytes crosses; each rollout rank takes views of the
received bucket and its engine copies them into place (slicing its tensor-parallel part).
Memory in flight: one bucket on each side.
"""
from __future__ import annotations

import itertools
import math
from typing import Iterable, Iterator, Sequence

import torch
import torch.distributed as dist

from hflow import lora

Manifest = list[tuple[str, tuple[int, ...]]]
DEFAULT_BUCKET_BYTES = 256 << 20


def weight_manifest(model: torch.nn.Module) -> Manifest:
    """(Hugging Face name, full shape) of every tensor the engine is given, in the order
    hflow.distributed.reshard.generation_weights yields them (the LoRA adapters are merged, not sent)."""
    return [(name, tuple(param.shape)) for name, param in model.named_parameters() if not lora.is_adapter(name)]


def buckets(manifest: Manifest, element_size: int, bucket_bytes: int) -> list[list[int]]:
    """The manifest's indices cut into consecutive buckets of at most `bucket_bytes` (a tensor
    larger than a bucket is a bucket of its own)."""
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes {bucket_bytes}: must be >= 1")
    out, current, size = [], [], 0
    for i, (_, shape) in enumerate(manifest):
        nbytes = math.prod(shape) * element_size
        if current and size + nbytes > bucket_bytes:
            out.append(current)
            current, size = [], 0
        current.append(i)
        size += nbytes
    if current:
        out.append(current)
    return out


def send_weights(named_tensors: Iterable[tuple[str, torch.Tensor]], manifest: Manifest, group, source: int,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES, is_source: bool = True) -> int:
    """Broadcast `named_tensors` (in manifest order, all of one dtype) from global rank `source`
    over `group`, bucket by bucket. Every actor rank consumes the iterator (its gathers are
    collective over the actor's ranks); only `is_source` packs and sends. Returns bytes sent."""
    tensors = iter(named_tensors)
    first = next(tensors, None)
    if first is None:
        return 0
    tensors, dtype, sent = itertools.chain([first], tensors), first[1].dtype, 0
    for bucket in buckets(manifest, first[1].element_size(), bucket_bytes):
        parts = [next(tensors, (None, None)) for _ in bucket]
        for (name, tensor), i in zip(parts, bucket):
            if name is None or (name, tuple(tensor.shape)) != manifest[i] or tensor.dtype != dtype:
                got = "nothing" if name is None else f"{name} {tuple(tensor.shape)} {tensor.dtype}"
                raise ValueError(f"send_weights: got {got}, the manifest says {manifest[i][0]} {manifest[i][1]} {dtype}")
        if is_source:
            flat = torch.cat([t.reshape(-1) for _, t in parts])
            dist.broadcast(flat, src=source, group=group)
            sent += flat.numel() * flat.element_size()
            del flat
        del parts
    if next(tensors, None) is not None:
        raise ValueError("send_weights: more tensors than the manifest names")
    return sent


def receive_weights(manifest: Manifest, dtype: torch.dtype, device: torch.device, group, source: int,
                    bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> Iterator[tuple[str, torch.Tensor]]:
    """What `send_weights` broadcasts, as (name, tensor) views of each received bucket; a
    bucket is released once its views are consumed."""
    element_size = torch.empty((), dtype=dtype).element_size()
    for bucket in buckets(manifest, element_size, bucket_bytes):
        shapes = [manifest[i][1] for i in bucket]
        flat = torch.empty(sum(math.prod(s) for s in shapes), dtype=dtype, device=device)
        dist.broadcast(flat, src=source, group=group)
        offset = 0
        for i, shape in zip(bucket, shapes):
            size = math.prod(shape)
            yield manifest[i][0], flat[offset:offset + size].view(shape)
            offset += size
        del flat


def joint_ranks(source: int, receivers: Sequence[int]) -> list[int]:
    """The members of the push group: the actor's sending rank and the rollout ranks."""
    if source in receivers:
        raise ValueError(f"the rollout ranks {list(receivers)} include the actor's rank {source}: a pushed "
                         f"rollout group sits on ranks of its own")
    return sorted({source, *receivers})
