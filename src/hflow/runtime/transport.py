"""The only module that touches torch.distributed.rpc.

RPC's TensorPipe backend is in maintenance upstream, so hflow keeps its whole use of it to four
functions: `start`, `send`, `stop` and the handler they deliver to. Swapping the transport
(plain sockets, a c10d store, ...) means rewriting this file, not the cluster or the workers.

Contract: `send(rank, payload)` returns a `torch.futures.Future` that completes with whatever
the remote handler's future completes with, or fails if the message cannot be delivered (peer
dead, connection lost, timeout). The handler runs on an RPC thread and must not block: it
returns a `torch.futures.Future` that it completes later (RPC's `async_execution`), so that a
long call never holds one of RPC's threads and the pool cannot run dry.
"""
from __future__ import annotations

import warnings
from typing import Callable

import torch
import torch.distributed.rpc as rpc

_handler: Callable[[object], torch.futures.Future] | None = None
CPU_CHANNELS = ("basic", "cma", "mpt_uv")   # TensorPipe's CPU channels (CUDA ones: cuda_*)


def _name(rank: int) -> str:
    return f"rank{rank}"


def start(rank: int, world_size: int, handler: Callable[[object], torch.futures.Future],
          num_threads: int = 16, init_timeout_s: float = 300.0) -> None:
    """Join the RPC world (rendezvous via env://, as torchrun sets it up)."""
    global _handler
    _handler = handler
    options = backend_options(num_threads, init_timeout_s)
    with warnings.catch_warnings():   # RPC's own init trips a deprecation warning of c10d
        warnings.filterwarnings("ignore", message="You are using a Backend")
        rpc.init_rpc(_name(rank), rank=rank, world_size=world_size, rpc_backend_options=options)


def backend_options(num_threads: int = 16, timeout_s: float = 300.0) -> rpc.TensorPipeRpcBackendOptions:
    # TCP via libuv, not TensorPipe's default shared-memory transport: that one busy-polls a
    # core per process even when idle (measured: 25 % of a core per idle rank, and 10x the
    # latency with 4 ranks on 2 cores, ~16 ms vs ~1.6 ms per call). Bulk data still avoids
    # the socket where it can (TensorPipe's cross-memory-attach channel on one host).
    # CPU channels only: hflow never sends CUDA tensors over RPC, and a CUDA build would
    # otherwise also set up the cuda_ipc / cuda_gdr channels, which have crashed at start-up on
    # some GPU and InfiniBand hosts.
    return rpc.TensorPipeRpcBackendOptions(num_worker_threads=num_threads, rpc_timeout=timeout_s,
                                           _transports=["uv"], _channels=list(CPU_CHANNELS))


@rpc.functions.async_execution
def _deliver(payload):
    return _handler(payload)


def send(rank: int, payload, timeout_s: float = 0) -> torch.futures.Future:
    """Deliver `payload` to `rank`'s handler; timeout_s=0 waits forever (a training step may
    take hours; dead peers are found by the cluster's heartbeat instead)."""
    return rpc.rpc_async(_name(rank), _deliver, args=(payload,), timeout=timeout_s)


def stop(graceful: bool = True, timeout_s: float = 60.0) -> None:
    """Leave the RPC world. graceful=True waits until every rank has called stop."""
    rpc.shutdown(graceful=graceful, timeout=timeout_s)
