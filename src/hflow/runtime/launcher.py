"""Starting a run: torchrun's environment, the process group and RPC, the flags, rank 0's main.

    hflow.launch(main, Config)      # every rank runs this line; rank 0 runs main(cluster, cfg)

Every rank joins the default process group (gloo on CPU; gloo for CPU tensors + NCCL for CUDA
ones on GPUs, device = LOCAL_RANK) and RPC; rank 0 parses and checks the flags, then runs
`main(cluster, cfg)` while the other ranks serve its calls (server.py) until it is done. A run
on one host talks over loopback only. Outside torchrun the process is a world of one.
"""
from __future__ import annotations

import dataclasses
import json
import os
import socket
import sys
import time
import traceback
from typing import Any, Callable

import torch
import torch.distributed as dist
import tyro

from hflow.checkpoint import output_dir_problems, prepare_output_dir
from hflow.distributed.parallel import pick_device, set_device
from hflow.model_defaults import resolve_defaults
from hflow.validation import ConfigError, UserError, check_config, notices

from . import stopping, transport
from .controller import Cluster, env_float
from .server import Server, hard_exit, log, this_process


def launch(main: Callable[[Cluster, Any], Any], cfg: Any = None):
    """Run `main(cluster, cfg)` on rank 0 with every other rank serving it. Call it on every
    rank (under torchrun; without it, runs as a single rank). Returns main's result on rank 0
    and None on the others; any failure ends every rank with exit status 1.

    `cfg` may be the recipe's Config class: rank 0 then parses the command line with tyro and
    checks every flag (hflow.validation) before anything loads, and a bad flag ends the run
    with one message on rank 0 and status 2 (`--help` prints once and ends with 0); the other
    ranks leave quietly."""
    _default_env()
    # the workers' calls run on the server's thread with this process's threads; the main thread
    # (rank 0's controller, the others' wait) keeps to one. A second OpenMP team in the process
    # puts libgomp over the cores and into throttled waits: every parallel region of the worker
    # then paid a wake-up, and the 0.86B MoE's rollouts on one rank took 14.5 s instead of 9.5 s
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    # Ctrl-C / SIGTERM: rank 0 finishes and saves the step, the others wait for it (stopping.py)
    stopping.install() if rank == 0 else stopping.ignore()
    _loopback_if_single_node(world_size)
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    wanted = os.environ.get("HFLOW_DEVICE", "cuda" if torch.cuda.is_available() else "cpu")
    device = pick_device(wanted, local_rank, int(os.environ.get("LOCAL_WORLD_SIZE", world_size)),
                         torch.cuda.device_count() if wanted.strip().lower() != "cpu" else 0)
    if device.type == "cuda":
        torch.cuda.set_device(device)
        backend = "cpu:gloo,cuda:nccl"
    else:
        backend = "gloo"
    set_device(device)
    dist.init_process_group(backend)
    cfg = _parse_and_check(cfg, rank)
    peers = [None] * world_size   # every rank's process: a frozen rank is ended by its finder
    dist.all_gather_object(peers, this_process())
    server = Server(rank, device, threads)
    transport.start(rank, world_size, server.handle)

    if rank != 0:
        server.serve(env_float("HFLOW_CONTROLLER_TIMEOUT_S", 15.0), controller=peers[0])
        _leave()
        return None

    cluster = Cluster(world_size, device, server, dict(enumerate(peers)))
    try:
        try:
            result = main(cluster, cfg)
        except SystemExit as e:   # sys.exit(0) in main is a normal end
            if e.code not in (None, 0):
                raise
            result = None
        cluster._close()
    except stopping.RunInterrupted as e:   # saved what it could: one message, the other ranks leave quietly
        log(str(e))
        _record_for_torchrun(str(e).splitlines()[0])
        _close_quietly(cluster, e)
    except UserError as e:   # e.g. a flag found wrong in main: the message is the story, no traceback
        _print_config_error(e)
        _close_quietly(cluster, e)
    except KeyboardInterrupt:   # a second Ctrl-C: stop now, without the step in progress
        cluster._abort("stopped at once by a second Ctrl-C (the step in progress is not saved; "
                       "--trainer.resume continues from the last checkpoint)", code=128 + 2)
    except BaseException as e:   # every rank must go
        traceback.print_exc()
        first_line = (str(e).splitlines() or [""])[0].split("; its traceback")[0]
        cluster._abort(f"the controller failed: {type(e).__name__}: {first_line}")
    _leave()
    return result


def _close_quietly(cluster: Cluster, e: UserError) -> None:
    """End with `e.exit_code` after rank 0 said why: the other ranks leave with status 0."""
    try:
        cluster._close()
        _leave()
    except BaseException:
        cluster._abort("stopped (see rank 0's message)", code=e.exit_code)
    hard_exit(e.exit_code)


def _parse_and_check(cfg, rank: int):
    """The Config class parsed from the command line and checked, on rank 0 only; the verdict
    is broadcast, so that every rank ends together on a bad flag or --help."""
    if cfg is None or not (isinstance(cfg, type) or dataclasses.is_dataclass(cfg)):
        return cfg
    verdict = [None]   # None: go on; else the exit status
    if rank == 0:
        try:
            if isinstance(cfg, type):
                cfg = tyro.cli(cfg, description=_description())
            cfg = resolve_defaults(cfg)   # main sees the values for the model in use
            check_config(cfg, output_dir_problems(getattr(cfg, "trainer", None)))
            for line in notices(cfg):
                log(f"note: {line}")
            if hasattr(cfg, "trainer"):
                prepare_output_dir(cfg.trainer)
        except SystemExit as e:    # tyro printed the usage error or the help
            verdict = [e.code if isinstance(e.code, int) else 2]
            if verdict[0] != 0:
                _record_for_torchrun("bad command-line flags (tyro's message above)")
        except ConfigError as e:
            _print_config_error(e)
            verdict = [2]
    dist.broadcast_object_list(verdict, src=0)
    if verdict[0] is not None:
        dist.destroy_process_group()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(verdict[0] if rank == 0 else 0)
    return cfg


def _description() -> str:
    """--help: the recipe's docstring, and where the ranks come from."""
    doc = (getattr(sys.modules.get("__main__"), "__doc__", None) or "").strip()
    return (doc + "\n\n" if doc else "") + (
        "Ranks: `torchrun --nproc-per-node N` starts N ranks (rank 0 runs the recipe, the others serve "
        "its calls); `python recipes/<recipe>.py` runs it as a single process, handy with breakpoint().")


def _print_config_error(e: UserError) -> None:
    lines = str(e).splitlines()
    log("\n".join(f"error: {line}" for line in lines))
    _record_for_torchrun(lines[0] if len(lines) == 1 else f"{len(lines)} bad flags, first: {lines[0]}")


def _record_for_torchrun(message: str) -> None:
    """torchrun prints a failed rank's error file in its summary ('traceback : ...'): put the
    message there instead of 'N/A' (TORCHELASTIC_ERROR_FILE is set by torchrun's agent)."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if path:
        with open(path, "w") as f:
            json.dump({"message": {"message": message, "extraInfo": {
                "py_callstack": message, "timestamp": str(int(time.time()))}}}, f)


def _leave() -> None:
    try:
        transport.stop(graceful=True)
        dist.destroy_process_group()
    except BaseException:
        traceback.print_exc()
        hard_exit(1)


def _loopback_if_single_node(world_size: int) -> None:
    """A run on one host talks over loopback only: gloo, NCCL's bootstrap and RPC bind to `lo`
    unless the user chose an interface. Their default is the interface the host name resolves
    to, which on most machines is reachable from the network, and the RPC agent executes what
    it is sent (see docs/cluster.md, the trust model). Multi-node runs keep the defaults (set
    GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME / TP_SOCKET_IFNAME to the cluster's interface)."""
    if int(os.environ.get("LOCAL_WORLD_SIZE", world_size)) != world_size:
        return
    for var in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "TP_SOCKET_IFNAME"):
        os.environ.setdefault(var, "lo")


def _default_env() -> None:
    """Outside torchrun, be a world of one."""
    if "RANK" in os.environ:
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
