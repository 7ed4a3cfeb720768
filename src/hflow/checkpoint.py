"""Checkpoints: sharded save/resume with torch.distributed.checkpoint, and Hugging Face export.

Layout of a checkpoint root (`--trainer.output-dir`/checkpoints):

    step_4/               complete: renamed from step_4.tmp only after every rank finished
      <name>/.metadata, __0_0.distcp, ...   one DCP checkpoint per sharded state (e.g. actor, critic)
      extra.pt            the controller's picklable dict (data position, KL controller, RNG, ...)
    step_6.tmp/           a save in progress, or one a crash interrupted: never read

The rename is the commit: a crash at any point leaves every earlier `step_N` intact, and
`latest_checkpoint` ignores `.tmp` directories.

Two ways to drive it:
- SPMD (every rank of one group runs the same code): `save_checkpoint` / `load_checkpoint`.
- Single controller (hflow's recipes): the controller calls `begin_save`, asks each worker group
  to `save_sharded(tmp / role, state, group)`, waits for all of them, writes `write_extra`, then
  `commit`. Resume: `latest_checkpoint`, each group `load_sharded(path / role, ...)`, `read_extra`.

Sharded state is a dict of `Stateful` objects (`ModelState`, `RNGState`) and/or tensors; DCP
saves each rank's shards in parallel and reshards on load. Optimizer state is initialised by
`get_state_dict` before loading, so a freshly built optimizer can be resumed into.
"""
import os
import pickle
import random
import re
import shutil
import warnings
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_state_dict, set_state_dict)
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from transformers import AutoTokenizer

from hflow.faults import fault_point

EXTRA_FILE = "extra.pt"
_STEP_DIR = re.compile(r"^step_(\d+)$")


# ---------------------------------------------------------------- what gets saved

class ModelState(Stateful):
    """A model (FSDP2-sharded or plain), its optimizer and LR scheduler, as one DCP item.

    `get_state_dict`/`set_state_dict` give optimizer state keyed by parameter name (not by
    position) as DTensors, which is what lets DCP reshard it across a different rank count.
    """

    def __init__(self, model: torch.nn.Module, optimizer=None, scheduler=None):
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler

    def state_dict(self):
        model_sd, optim_sd = get_state_dict(self.model, self._optimizers())
        out = {"model": model_sd}
        if self.optimizer is not None:
            out["optimizer"] = optim_sd
        if self.scheduler is not None:
            out["scheduler"] = self.scheduler.state_dict()
        return out

    def load_state_dict(self, state_dict):
        set_state_dict(self.model, self._optimizers(), model_state_dict=state_dict["model"],
                       optim_state_dict=state_dict.get("optimizer", {}))
        if self.scheduler is not None:
            self.scheduler.load_state_dict(state_dict["scheduler"])

    def _optimizers(self):
        return [] if self.optimizer is None else [self.optimizer]


def rng_state() -> dict:
    """This process's random streams: torch (CPU and CUDA), Python `random`, numpy."""
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    try:
        import numpy as np   # optional: numpy's stream is saved when numpy is there
        state["numpy"] = np.random.get_state()
    except ImportError:
        pass
    return state


def set_rng_state(state: dict):
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if "numpy" in state:
        import numpy as np   # optional, as in rng_state
        np.random.set_state(state["numpy"])


class RNGState(Stateful):
    """Every rank's random streams. Ranks draw differently, so each is saved under its own key
    (`rank<r>`): resuming them needs the same number of ranks."""

    def __init__(self, process_group=None):
        self.rank = dist.get_rank(process_group) if dist.is_initialized() else 0

    def state_dict(self):
        # Pickled to bytes: DCP would otherwise treat the rank's CPU generator tensor as a model
        # tensor and the tuples as nested containers; one opaque blob per rank is what we want.
        return {f"rank{self.rank}": pickle.dumps(rng_state())}

    def load_state_dict(self, state_dict):
        set_rng_state(pickle.loads(state_dict[f"rank{self.rank}"]))


# ---------------------------------------------------------------- directories

def checkpoint_dir(root, step: int) -> Path:
    return Path(root) / f"step_{step}"


def temporary_dir(root, step: int) -> Path:
    return Path(root) / f"step_{step}.tmp"


def checkpoint_step(path) -> int:
    """The step of a `step_N` directory."""
    match = _STEP_DIR.match(Path(path).name)
    if match is None:
        raise ValueError(f"{path} is not a checkpoint directory (expected a name like step_12)")
    return int(match.group(1))


def list_checkpoints(root) -> list[Path]:
    """Complete checkpoints under `root`, oldest first (`.tmp` and other names ignored)."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and _STEP_DIR.match(p.name)]
    return sorted(found, key=checkpoint_step)


def latest_checkpoint(root) -> Path | None:
    """The complete checkpoint with the highest step, or None."""
    found = list_checkpoints(root)
    return found[-1] if found else None


def begin_save(root, step: int) -> Path:
    """Make an empty `step_N.tmp` (a leftover of an interrupted save is cleared). One process."""
    tmp = temporary_dir(root, step)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    return tmp


def commit(root, step: int, keep_last: int | None = None) -> Path:
    """Rename `step_N.tmp` to `step_N` once everything is written; keep the last `keep_last`.

    Call on one process, after every rank's save returned. An existing `step_N` (a run resumed
    from an earlier step) is replaced: it is moved aside first, so that a crash between the two
    renames still leaves the older checkpoints.
    """
    tmp, final = temporary_dir(root, step), checkpoint_dir(root, step)
    if not tmp.is_dir():
        raise FileNotFoundError(f"nothing to commit: {tmp} does not exist (call begin_save first)")
    old = None
    if final.exists():
        old = final.with_name(final.name + ".old")
        shutil.rmtree(old, ignore_errors=True)
        os.rename(final, old)
    os.rename(tmp, final)
    _fsync_dir(final.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    _prune(root, step, keep_last)
    return final


def _fsync_dir(path: Path):
    # Make the rename itself durable (POSIX), not only the files inside.
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _prune(root, step: int, keep_last: int | None):
    root = Path(root)
    # Interrupted saves of earlier steps will never be completed.
    for path in root.glob("step_*.tmp"):
        match = re.match(r"^step_(\d+)\.tmp$", path.name)
        if match and int(match.group(1)) < step:
            shutil.rmtree(path, ignore_errors=True)
    if keep_last is not None and keep_last > 0:
        for path in list_checkpoints(root)[:-keep_last]:
            shutil.rmtree(path, ignore_errors=True)


# ---------------------------------------------------------------- sharded state (collective)

def save_sharded(path, state: dict, process_group=None):
    """Save `state` (Stateful objects and/or tensors) with DCP. Collective over `process_group`
    (the default group when None, or a single process when torch.distributed is not set up)."""
    with _single_process_is_fine():
        dcp.save(state, checkpoint_id=Path(path), process_group=process_group,
                 no_dist=not dist.is_initialized())


def load_sharded(path, state: dict, process_group=None):
    """Load into `state` in place (Stateful objects get `load_state_dict`). Collective."""
    path = Path(path)
    if not (path / ".metadata").exists():
        raise FileNotFoundError(f"{path} holds no checkpoint (no .metadata file)")
    with _single_process_is_fine():
        dcp.load(state, checkpoint_id=path, process_group=process_group,
                 no_dist=not dist.is_initialized())


@contextmanager
def _single_process_is_fine():
    # DCP warns that it "assumes" a single process even when no_dist=True says so.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def write_extra(path, extra: dict):
    """The controller's own state (anything picklable) as `<path>/extra.pt`. One process."""
    tmp = Path(path) / (EXTRA_FILE + ".part")
    torch.save(extra, tmp)
    os.replace(tmp, Path(path) / EXTRA_FILE)


def read_extra(path) -> dict:
    file = Path(path) / EXTRA_FILE
    return torch.load(file, weights_only=False) if file.exists() else {}


# ---------------------------------------------------------------- SPMD wrappers

def _rank(group) -> int:
    return dist.get_rank(group) if dist.is_initialized() else 0


def _barrier(group):
    if dist.is_initialized():
        dist.barrier(group=group)


def save_checkpoint(root, step: int, state: dict, extra: dict | None = None,
                    keep_last: int | None = None, process_group=None) -> Path:
    """Every rank of the group calls this: sharded `state` plus rank 0's `extra`, committed
    atomically as `<root>/step_<step>`. Returns the final directory."""
    if _rank(process_group) == 0:
        begin_save(root, step)
    _barrier(process_group)                    # the directory is clean before anyone writes
    tmp = temporary_dir(root, step)
    save_sharded(tmp / "state", state, process_group)
    if _rank(process_group) == 0:
        write_extra(tmp, extra or {})
    _barrier(process_group)                    # every rank's shards are on disk
    if _rank(process_group) == 0:
        commit(root, step, keep_last)
    _barrier(process_group)                    # nobody returns before the checkpoint exists
    return checkpoint_dir(root, step)


def load_checkpoint(path, state: dict, process_group=None) -> dict:
    """Every rank calls this: loads `state` in place from `save_checkpoint`'s directory and
    returns the extra dict."""
    load_sharded(Path(path) / "state", state, process_group)
    return read_extra(path)


# ---------------------------------------------------------------- Hugging Face export

def export_hf(model, path, tokenizer=None, process_group=None) -> Path:
    """Write `model` (a transformers causal LM, FSDP2-sharded or not) as a Hugging Face
    directory: safetensors + config + generation config (+ tokenizer, an object or a directory
    to copy it from). Collective over the model's ranks; rank 0 of `process_group` writes.

    Parameters are gathered one at a time and moved to CPU on the writing rank only, so the
    extra accelerator memory is one full parameter. (`get_model_state_dict` with
    `full_state_dict=True, cpu_offload=True` would keep the tensors on *global* rank 0, which
    is not in the group when the actor does not live on rank 0.)
    """
    writer = _rank(process_group) == 0
    sharded = get_model_state_dict(model, options=StateDictOptions(full_state_dict=False))
    full = {}
    for name, tensor in sharded.items():
        if isinstance(tensor, DTensor):
            tensor = tensor.full_tensor()      # collective over the parameter's mesh
        if writer:
            full[name] = tensor.detach().to("cpu", copy=True)
        del tensor
    path = Path(path)
    if writer:
        _save_pretrained(model, full, path, tokenizer)
    _barrier(process_group)
    return path


def _save_pretrained(model, state_dict: dict, path: Path, tokenizer):
    # fully_shard swaps the module's class for a subclass named FSDP<Class>; save_pretrained
    # would write that name into config.architectures. Rebuild the plain class on the meta
    # device and assign the gathered tensors to it instead.

    cls = next(c for c in type(model).__mro__ if not issubclass(c, FSDPModule))
    with torch.device("meta"):
        plain = cls(model.config)
    plain.load_state_dict(state_dict, strict=True, assign=True)
    if getattr(model.config, "tie_word_embeddings", False):
        plain.tie_weights()
    if getattr(model, "generation_config", None) is not None:
        plain.generation_config = model.generation_config
    path.mkdir(parents=True, exist_ok=True)
    plain.save_pretrained(path, safe_serialization=True)
    if tokenizer is not None:
        if isinstance(tokenizer, (str, os.PathLike)):
            tokenizer = AutoTokenizer.from_pretrained(tokenizer)
        tokenizer.save_pretrained(path)


# ---- checkpoints of a whole run: every trained worker group + the controller's state -----------

def save_run(root, step: int, groups: dict, extra: dict, keep_last: int | None = None) -> Path:
    """Checkpoint every trainable worker group (sharded, in parallel) and the controller's own
    state, committed as `<root>/step_<step>` only when all of it is written."""
    tmp = begin_save(root, step)
    futures = [group.save.future(str(tmp / role)) for role, group in groups.items()]
    for future in futures:
        future.result()
    write_extra(tmp, {**extra, "rng": rng_state()})
    fault_point("checkpoint")
    return commit(root, step, keep_last)


def resume_run(root, groups: dict) -> dict | None:
    """Load the latest complete checkpoint under `root` into the groups; returns the controller
    state saved with it (None when there is none)."""
    path = latest_checkpoint(root)
    if path is None:
        return None
    for future in [group.load.future(str(path / role)) for role, group in groups.items()]:
        future.result()
    extra = read_extra(path)
    set_rng_state(extra.pop("rng"))
    return {**extra, "step": checkpoint_step(path)}
