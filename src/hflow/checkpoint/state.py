"""What gets saved: a model with its optimizer and schedule (`ModelState`), and random streams
(`rng_state`, `RNGState`)."""
from __future__ import annotations

import random

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful

from . import safe_format


class ModelState(Stateful):
    """A model (FSDP2-sharded or plain), its optimizer and LR scheduler, as one DCP item.

    `get_state_dict`/`set_state_dict` give optimizer state keyed by parameter name (not by
    position) as DTensors, which is what lets DCP reshard it across a different rank count.
    """

    def __init__(self, model: torch.nn.Module, optimizer=None, scheduler=None):
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler

    def state_dict(self):
        model_sd, optim_sd = get_state_dict(self.model, self._optimizers())
        # frozen weights (a LoRA model's base) are the model directory's: only what trains is kept
        out = {"model": {k: v for k, v in model_sd.items() if k not in self._frozen()}}
        if self.optimizer is not None:
            out["optimizer"] = optim_sd
        if self.scheduler is not None:
            out["scheduler"] = self.scheduler.state_dict()
        return out

    def load_state_dict(self, state_dict):
        set_state_dict(self.model, self._optimizers(), model_state_dict=state_dict["model"],
                       optim_state_dict=state_dict.get("optimizer", {}),
                       options=StateDictOptions(strict=not self._frozen()))
        if self.scheduler is not None:
            self.scheduler.load_state_dict(state_dict["scheduler"])

    def _frozen(self) -> set[str]:
        """Names of the frozen parameters of a model that also trains some (none otherwise: a
        frozen model's checkpoint, if ever written, keeps its weights)."""
        params = dict(self.model.named_parameters())
        frozen = {n for n, p in params.items() if not p.requires_grad}
        return frozen if len(frozen) < len(params) else set()

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
        # One opaque string per rank: DCP would otherwise treat the CPU generator's tensor as a
        # model tensor and the tuples as nested containers. JSON, so that loading runs no code.
        return {f"rank{self.rank}": safe_format.dumps(rng_state(), f"rank {self.rank}'s RNG state")}

    def load_state_dict(self, state_dict):
        saved = state_dict[f"rank{self.rank}"]
        if isinstance(saved, bytes):   # hflow before JSON: a pickle, read through an allowlist
            saved = safe_format.legacy_rng_blob(saved, f"rank {self.rank}'s RNG state")
        else:
            saved = safe_format.loads(saved)
        set_rng_state(saved)
