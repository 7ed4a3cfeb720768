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

        @dispatch("notice")      # as "all", but delivered at once, beside a call still running
        def offer(self, version): self.offered = version

"notice" skips each rank's queue of calls (hflow.runtime.server runs the method on an RPC thread as soon
as it arrives), so a long call that is running (a rollout) can see what it records between its
steps. Such a method must only record something: no collectives, nothing that blocks.

"dp" in detail, for a group of R ranks whose mesh has a "dp" dim of size D:
  - every Batch argument (positional or keyword; all must have the same length N) is padded to
    a multiple of D by repeating real rows, then cut into D equal shards of m = ceil(N/D) rows;
  - rank r gets shard dp_index(r); ranks sharing a dp index (tensor-parallel peers) get the
    same shard, and only the first of them (in mesh order) sends its result back;
  - Batch results are concatenated in dp order after dropping the padding of each shard. A
    shard may return k rows per input row (e.g. n samples per prompt), grouped by input row as
    `Batch.repeat(k, interleave=True)` lays them out; the padding's k*p rows are dropped;
  - any other result comes back as a list with one entry per dp shard.

`@dispatch("dp", balance=cost)` also evens out the work: FSDP syncs every layer, so the rank
with the most work sets the pace of a forward or an update. `cost(batch) -> list[int]` is the
worker's own measure of each row's work (the training workers': the tokens a packed pass
computes, hflow.workers.micro_batches.packed_row_tokens), applied to the first Batch argument.
Before cutting, rows are swapped between shards by that cost, and only among rows at the same
position of their shards: a row keeps its position i in its shard, so it stays in mini-batch
i % M for every M (strided mini-batches are the same sets with or without balancing, on any
number of ranks). The n rows of a prompt (meta "n") move together when n divides the shard, so
that their prompt is packed once. Batch results come back in the caller's order. Only for
methods whose rows are independent (not pairs or groups that must stay on one rank).
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Callable

import torch

from hflow.batch import Batch

MODES = ("all", "dp", "one", "notice")
_ATTR = "__hflow_dispatch__"


RowCost = Callable[[Batch], list[int]]


def dispatch(mode: str, balance: RowCost | None = None) -> Callable:
    """Mark a worker method as callable from the controller, dispatched by `mode`; `balance`
    (mode "dp" only), the work of each row of a Batch, evens out the shards' work (see the
    module docstring)."""
    if mode not in MODES:
        raise ValueError(f"dispatch mode must be one of {MODES}, got {mode!r}")
    if balance is not None and mode != "dp":
        raise ValueError(f"balance applies to dispatch mode 'dp', not {mode!r}")
    if balance is not None and not callable(balance):
        raise TypeError(f"balance is a function of a Batch giving each row's work, not {balance!r}")

    def mark(fn):
        setattr(fn, _ATTR, (mode, balance))
        return fn
    return mark


def mode_of(fn) -> str | None:
    return getattr(fn, _ATTR, (None,))[0]


def balances(fn) -> RowCost | None:
    """The row cost a method's shards are balanced by, or None."""
    return getattr(fn, _ATTR, (None, None))[1]


def balanced_order(lengths: list[int], shards: int, unit: int = 1) -> list[int]:
    """A row order for cutting `len(lengths)` rows into `shards` equal contiguous shards whose
    total lengths are close: order[j] is the row placed at j. Rows only trade places with the
    rows at the same position of the other shards (order[j] % m == j % m, m rows a shard), in
    runs of `unit` consecutive rows (the n samples of a prompt stay together) when unit divides m.

    Greedy, position by position: the longest of the position's runs goes to the shard that is
    lightest so far, and so on; the spread between shards never exceeds the longest run."""
    if len(lengths) % shards:
        raise ValueError(f"{len(lengths)} rows do not cut into {shards} equal shards")
    m = len(lengths) // shards
    unit = unit if unit > 1 and m % unit == 0 else 1
    runs = [sum(lengths[u:u + unit]) for u in range(0, len(lengths), unit)]
    per_shard = m // unit
    load = [0] * shards
    order = list(range(len(runs)))
    for i in range(per_shard):
        candidates = sorted((r * per_shard + i for r in range(shards)), key=lambda run: -runs[run])
        lightest = sorted(range(shards), key=lambda r: load[r])
        for run, shard in zip(candidates, lightest):
            order[shard * per_shard + i] = run
            load[shard] += runs[run]
    return [run * unit + k for run in order for k in range(unit)]


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


@dataclass(frozen=True)
class _DpContext:
    rows: int | None               # the caller's Batch length (None: no Batch argument)
    order: list[int] | None        # balanced_order of the padded rows, or None (as they came)


def scatter(mode: str, grid: RankGrid, args: tuple, kwargs: dict,
            balance: RowCost | None = None) -> tuple[list[RankCall], Any]:
    """Per-rank arguments for a call, plus the context `gather` needs; `balance`: the row cost
    to even the shards' work by (dispatch's), or None."""
    if mode in ("all", "notice"):
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

    padded = {key: b.pad(n_shards)[0] for key, b in batch_args + batch_kwargs}   # pad each once
    order = None
    if balance is not None and n_shards > 1 and padded:
        first = next(iter(padded.values()))
        order = balanced_order(balance(first), n_shards, unit=int(first.meta.get("n", 1)))

    def shards(key) -> list[Batch]:
        return (padded[key] if order is None else padded[key][order]).split(n_shards)
    arg_shards = {i: shards(i) for i, _ in batch_args}
    kwarg_shards = {k: shards(k) for k, _ in batch_kwargs}

    leaders = set(grid.dp_leaders())
    calls = []
    for rank in grid.ranks:
        d = grid.dp_index(rank)
        rank_args = tuple(arg_shards[i][d] if i in arg_shards else a for i, a in enumerate(args))
        rank_kwargs = {k: kwarg_shards[k][d] if k in kwarg_shards else a
                       for k, a in kwargs.items()}
        calls.append(RankCall(rank, rank_args, rank_kwargs, rank in leaders))
    return calls, _DpContext(n_rows, order)


def gather(mode: str, grid: RankGrid, context, results: dict[int, Any]) -> Any:
    """Combine per-rank results (rank -> value) into what the controller's call returns."""
    if mode in ("all", "notice"):
        return [results[r] for r in grid.ranks]
    if mode == "one":
        return results[grid.ranks[0]]

    outs = [results[r] for r in grid.dp_leaders()]
    n_rows = context.rows
    if n_rows is None or not all(isinstance(o, Batch) for o in outs):
        return outs
    shard_rows = -(-n_rows // len(outs))                       # m = ceil(N / D)
    if context.order is not None:
        return _unbalance(outs, shard_rows, n_rows, context.order)
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


def _unbalance(outs: list[Batch], shard_rows: int, n_rows: int, order: list[int]) -> Batch:
    """The shards' results of a balanced call in the caller's row order, padding dropped."""
    if len({len(out) for out in outs}) > 1 or len(outs[0]) % shard_rows:
        raise ValueError(f"dispatch 'dp' with balance: each shard got {shard_rows} rows and they "
                         f"returned {[len(out) for out in outs]}, not one multiple k of that, so "
                         f"the rows cannot be put back in order; return k rows per input row")
    per_row = len(outs[0]) // shard_rows                          # k
    at = torch.empty(len(order), dtype=torch.long)               # the result of padded row order[j] is at j
    at[torch.tensor(order)] = torch.arange(len(order))
    out = Batch.concat(outs)[(at[:, None] * per_row + torch.arange(per_row)).flatten()]
    return out[:n_rows * per_row]                                 # the padding is last
