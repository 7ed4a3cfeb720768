"""How one controller call fans out over a worker group, and how the results come back.

A worker method declares its mode with a decorator:

    class Critic:
        def __init__(self, mesh, cfg): ...

        @dispatch("dp")          # split Batch args along the mesh's "dp" dim, concat results
        def values(self, batch: Batch) -> Batch: ...

        @dispatch("all")         # same args to every rank, results as a list (group order)
        def load(self, path): ...

        @dispatch("one")         # the group's first rank only
        def state_summary(self): ...

"dp" in detail, for a group of R ranks whose mesh has a "dp" dim of size D:
  - every Batch argument (positional or keyword; all must have the same length N) is padded to
    a multiple of D by repeating real rows, then cut into D equal shards of m = ceil(N/D) rows;
  - rank r gets shard dp_index(r); ranks sharing a dp index (tensor-parallel peers) get the
    same shard, and only the first of them (in mesh order) sends its result back;
  - Batch results are concatenated in dp order after dropping the padding of each shard. A
    shard may return k rows per input row (e.g. n samples per prompt), grouped by input row as
    `Batch.repeat(k, interleave=True)` lays them out; the padding's k*p rows are dropped;
  - any other result comes back as a list with one entry per dp shard.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Callable

import torch

from .batch import Batch

MODES = ("all", "dp", "one")
_ATTR = "__hflow_dispatch__"


def dispatch(mode: str) -> Callable:
    """Mark a worker method as callable from the controller, dispatched by `mode`."""
    if mode not in MODES:
        raise ValueError(f"dispatch mode must be one of {MODES}, got {mode!r}")

    def mark(fn):
        setattr(fn, _ATTR, mode)
        return fn
    return mark


def mode_of(fn) -> str | None:
    return getattr(fn, _ATTR, None)


@dataclass(frozen=True)
class RankGrid:
    """A group's ranks arranged as its DeviceMesh will be: `mesh` is a nested list of global ranks."""
    mesh: tuple
    dim_names: tuple[str, ...]

    @staticmethod
    def of(ranks: list[int], shape: tuple[int, ...], dim_names: tuple[str, ...]) -> "RankGrid":
        if len(shape) != len(dim_names):
            raise ValueError(f"mesh shape {shape} has {len(shape)} dims but names {dim_names}")
        if torch.Size(shape).numel() != len(ranks):
            raise ValueError(f"mesh shape {shape} does not fit the {len(ranks)} ranks {ranks}")
        array = torch.tensor(ranks).reshape(shape)
        return RankGrid(_freeze(array.tolist()), tuple(dim_names))

    # cached: a call looks these up once per rank
    @cached_property
    def array(self) -> torch.Tensor:
        return torch.tensor(self.mesh)

    @cached_property
    def ranks(self) -> list[int]:
        return self.array.flatten().tolist()

    @cached_property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.array.shape)

    @cached_property
    def _coordinates(self) -> dict[int, tuple[int, ...]]:
        # itertools.product walks the mesh in the same row-major order as flatten()
        return dict(zip(self.ranks, itertools.product(*map(range, self.shape))))

    def coordinate(self, rank: int) -> tuple[int, ...]:
        return self._coordinates[rank]

    def dp_dim(self) -> int:
        if "dp" not in self.dim_names:
            raise ValueError(f"dispatch 'dp' needs a mesh dim named 'dp'; this group's mesh "
                             f"dims are {self.dim_names}")
        return self.dim_names.index("dp")

    @property
    def dp_size(self) -> int:
        return self.shape[self.dp_dim()]

    def dp_index(self, rank: int) -> int:
        return self.coordinate(rank)[self.dp_dim()]

    def dp_leaders(self) -> list[int]:
        """For each dp index, the first rank (mesh order) holding it: the one that answers."""
        leaders: dict[int, int] = {}
        for rank in self.ranks:
            leaders.setdefault(self.dp_index(rank), rank)
        return [leaders[i] for i in range(self.dp_size)]


def _freeze(x):
    return tuple(_freeze(v) for v in x) if isinstance(x, list) else x


@dataclass
class RankCall:
    """What one rank receives for one controller call."""
    rank: int
    args: tuple
    kwargs: dict
    returns: bool          # False: run it, but send back nothing (a tp peer's duplicate)


def scatter(mode: str, grid: RankGrid, args: tuple, kwargs: dict) -> tuple[list[RankCall], Any]:
    """Per-rank arguments for a call, plus the context `gather` needs."""
    if mode == "all":
        return [RankCall(r, args, kwargs, True) for r in grid.ranks], None
    if mode == "one":
        return [RankCall(grid.ranks[0], args, kwargs, True)], None
    if mode != "dp":
        raise ValueError(f"unknown dispatch mode {mode!r}")

    n_shards = grid.dp_size
    batch_args = [(i, a) for i, a in enumerate(args) if isinstance(a, Batch)]
    batch_kwargs = [(k, a) for k, a in kwargs.items() if isinstance(a, Batch)]
    lengths = {len(b) for _, b in batch_args + batch_kwargs}
    if len(lengths) > 1:
        raise ValueError(f"dispatch 'dp': Batch arguments have different lengths {lengths}")
    n_rows = lengths.pop() if lengths else None

    def shards(b: Batch) -> list[Batch]:
        padded, _ = b.pad(n_shards)
        return padded.split(n_shards)
    arg_shards = {i: shards(b) for i, b in batch_args}
    kwarg_shards = {k: shards(b) for k, b in batch_kwargs}

    leaders = set(grid.dp_leaders())
    calls = []
    for rank in grid.ranks:
        d = grid.dp_index(rank)
        rank_args = tuple(arg_shards[i][d] if i in arg_shards else a for i, a in enumerate(args))
        rank_kwargs = {k: kwarg_shards[k][d] if k in kwarg_shards else a
                       for k, a in kwargs.items()}
        calls.append(RankCall(rank, rank_args, rank_kwargs, rank in leaders))
    return calls, n_rows


def gather(mode: str, grid: RankGrid, n_rows, results: dict[int, Any]) -> Any:
    """Combine per-rank results (rank -> value) into what the controller's call returns."""
    if mode == "all":
        return [results[r] for r in grid.ranks]
    if mode == "one":
        return results[grid.ranks[0]]

    outs = [results[r] for r in grid.dp_leaders()]
    if n_rows is None or not all(isinstance(o, Batch) for o in outs):
        return outs
    shard_rows = -(-n_rows // len(outs))                       # m = ceil(N / D)
    kept = []
    for i, out in enumerate(outs):
        real = min(max(n_rows - i * shard_rows, 0), shard_rows)  # rows of shard i not padding
        if real == shard_rows:
            kept.append(out)
            continue
        if len(out) % shard_rows:
            raise ValueError(f"dispatch 'dp': shard {i} got {shard_rows} rows ({shard_rows - real}"
                             f" of them padding) and returned {len(out)}, not a multiple, so "
                             f"the padding cannot be removed; send a batch that divides by "
                             f"the dp size {len(outs)}")
        kept.append(out[:real * (len(out) // shard_rows)])
    return Batch.concat(kept)
