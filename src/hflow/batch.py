"""Batch: the unit of data that flows between the controller and worker groups.

A Batch is a set of named columns that share their first dimension (the rows), plus a `meta`
dict for whatever is not per-row (a temperature, a step number, metrics):

    b = Batch({"input_ids": ids,          # torch.Tensor [rows, ...]  -> a tensor column
               "prompt": ["1+1=", "2+2="]},  # list, one object per row -> an object column
              meta={"temperature": 1.0})
    len(b), b["input_ids"], b["score"] = scores, b[2:4], b.select("input_ids")
    b | other                     # union of columns (a key in both is an error)
    Batch.concat(b.split(4))      # == b

Tensor columns are whole tensors, never lists of per-row tensors, so a Batch crossing RPC is
a few large tensors (which RPC sends as raw buffers) plus the pickled object columns and meta.
"""
from __future__ import annotations

from typing import Any, Iterable, Sequence

import torch


class Batch:
    def __init__(self, columns: dict[str, Any] | None = None, meta: dict | None = None):
        self._cols: dict[str, torch.Tensor | list] = {}
        self.meta: dict = dict(meta or {})
        for key, value in (columns or {}).items():
            self[key] = value

    # ---- columns ---------------------------------------------------------------------------
    def __len__(self) -> int:
        for value in self._cols.values():
            return len(value)
        return 0

    def keys(self):
        return self._cols.keys()

    def items(self):
        return self._cols.items()

    def __contains__(self, key: str) -> bool:
        return key in self._cols

    @property
    def tensors(self) -> dict[str, torch.Tensor]:
        return {k: v for k, v in self._cols.items() if isinstance(v, torch.Tensor)}

    @property
    def objects(self) -> dict[str, list]:
        return {k: v for k, v in self._cols.items() if not isinstance(v, torch.Tensor)}

    def __getitem__(self, key):
        """`b["name"]` is a column; `b[rows]` (int, slice, list or tensor of indices, or a bool
        mask) is a new Batch of those rows."""
        if isinstance(key, str):
            if key not in self._cols:
                raise KeyError(f"Batch has no column {key!r}; it has {sorted(self._cols)}")
            return self._cols[key]
        return self._take(key)

    def __setitem__(self, key: str, value) -> None:
        if not isinstance(key, str):
            raise TypeError(f"Batch column names are strings, got {key!r}")
        if isinstance(value, torch.Tensor):
            if value.dim() == 0:
                raise ValueError(f"Batch column {key!r} is a 0-d tensor; it has no rows "
                                 f"(put per-batch values in batch.meta)")
        elif isinstance(value, (list, tuple)):
            value = list(value)
        else:
            raise TypeError(f"Batch column {key!r} must be a tensor or a list with one "
                            f"object per row, got {type(value).__name__} "
                            f"(put per-batch values in batch.meta)")
        for other, column in self._cols.items():
            if other == key:
                continue
            if len(column) != len(value):
                raise ValueError(f"Batch column {key!r} has {len(value)} rows but column "
                                 f"{other!r} has {len(column)}: all columns share dim 0")
            break
        self._cols[key] = value

    def __delitem__(self, key: str) -> None:
        del self._cols[key]

    def select(self, *keys: str) -> "Batch":
        """A Batch with only these columns (meta is kept)."""
        return Batch({k: self[k] for k in keys}, self.meta)

    def drop(self, *keys: str) -> "Batch":
        return Batch({k: v for k, v in self._cols.items() if k not in keys}, self.meta)

    def __or__(self, other: "Batch") -> "Batch":
        """Union of columns and meta. A column in both, or a meta key with two different
        values, is an error: silently overwriting data is how RL pipelines go wrong."""
        if not isinstance(other, Batch):
            return NotImplemented
        clash = sorted(set(self._cols) & set(other._cols))
        if clash:
            raise KeyError(f"Batch union: both sides have column(s) {clash}; "
                           f"drop or rename them first")
        if len(self._cols) and len(other._cols) and len(self) != len(other):
            raise ValueError(f"Batch union: {len(self)} rows vs {len(other)} rows")
        meta = dict(self.meta)
        for key, value in other.meta.items():
            if key in meta and not _same(meta[key], value):
                raise KeyError(f"Batch union: meta {key!r} differs ({meta[key]!r} vs {value!r})")
            meta[key] = value
        return Batch({**self._cols, **other._cols}, meta)

    # ---- rows ------------------------------------------------------------------------------
    def _take(self, index) -> "Batch":
        if isinstance(index, int):
            index = slice(index, index + 1 if index != -1 else None)
        if isinstance(index, slice):
            return Batch({k: v[index] for k, v in self._cols.items()}, self.meta)
        index = torch.as_tensor(index)
        if index.dtype == torch.bool:
            index = index.nonzero().flatten()
        rows = index.tolist()
        out = {}
        for k, v in self._cols.items():
            out[k] = v.index_select(0, index.to(v.device)) if isinstance(v, torch.Tensor) \
                else [v[i] for i in rows]
        return Batch(out, self.meta)

    def split(self, parts: int | Sequence[int]) -> list["Batch"]:
        """Split into `parts` pieces whose sizes differ by at most one (the first ones are the
        larger), or into pieces of the given sizes. Pieces are views of the tensors."""
        if isinstance(parts, int):
            if parts < 1:
                raise ValueError(f"split into {parts} parts")
            base, extra = divmod(len(self), parts)
            sizes = [base + (i < extra) for i in range(parts)]
        else:
            sizes = list(parts)
            if sum(sizes) != len(self):
                raise ValueError(f"split sizes {sizes} sum to {sum(sizes)}, not {len(self)} rows")
        out, start = [], 0
        for size in sizes:
            out.append(self[start:start + size])
            start += size
        return out

    @staticmethod
    def concat(batches: Iterable["Batch"]) -> "Batch":
        """Rows of all batches, in order. Columns must match. Meta values that agree are kept;
        a meta key whose values differ between parts becomes the list of the parts' values
        (e.g. a metric computed on each data-parallel shard)."""
        batches = list(batches)
        if not batches:
            raise ValueError("concat of no batches")
        keys = list(batches[0].keys())
        for i, b in enumerate(batches[1:], 1):
            if set(b.keys()) != set(keys):
                raise KeyError(f"concat: batch 0 has columns {sorted(keys)}, batch {i} has "
                               f"{sorted(b.keys())}")
        cols = {}
        for k in keys:
            parts = [b[k] for b in batches]
            if isinstance(parts[0], torch.Tensor):
                cols[k] = torch.cat(parts) if len(parts) > 1 else parts[0]
            else:
                cols[k] = [x for p in parts for x in p]
        meta = {}
        for key in dict.fromkeys(k for b in batches for k in b.meta):
            values = [b.meta.get(key) for b in batches]
            same = all(_same(values[0], v) for v in values[1:])
            meta[key] = values[0] if same else values
        return Batch(cols, meta)

    def repeat(self, n: int, interleave: bool = True) -> "Batch":
        """Each row n times: interleave=True gives a a b b (samples of one prompt adjacent, as
        GRPO groups want), interleave=False gives a b a b."""
        index = torch.arange(len(self))
        index = index.repeat_interleave(n) if interleave else index.repeat(n)
        return self._take(index)

    def pad(self, multiple: int) -> tuple["Batch", int]:
        """Pad to a multiple of `multiple` rows by repeating rows from the start (real rows,
        so no worker ever sees a fake empty sequence). Returns (padded, number of pad rows)."""
        if len(self) == 0:
            raise ValueError("cannot pad an empty Batch")
        n_pad = -len(self) % multiple
        if n_pad == 0:
            return self, 0
        index = torch.cat([torch.arange(len(self)), torch.arange(n_pad) % len(self)])
        return self._take(index), n_pad

    def unpad(self, n_pad: int) -> "Batch":
        """Drop the last n_pad rows (undoes `pad`)."""
        return self[:len(self) - n_pad] if n_pad else self

    # ---- devices and copies ----------------------------------------------------------------
    def to(self, device, non_blocking: bool = False) -> "Batch":
        return Batch({k: v.to(device, non_blocking=non_blocking) if isinstance(v, torch.Tensor)
                      else v for k, v in self._cols.items()}, self.meta)

    def clone(self) -> "Batch":
        """Tensors cloned, object columns and meta copied shallowly."""
        return Batch({k: v.detach().clone() if isinstance(v, torch.Tensor) else list(v)
                      for k, v in self._cols.items()}, dict(self.meta))

    def __repr__(self) -> str:
        cols = ", ".join(f"{k}: {tuple(v.shape)} {str(v.dtype).replace('torch.', '')}"
                         if isinstance(v, torch.Tensor) else f"{k}: list"
                         for k, v in self._cols.items())
        meta = f", meta={sorted(self.meta)}" if self.meta else ""
        return f"Batch({len(self)} rows; {cols}{meta})"

    # Pickled as plain containers: RPC's pickler then ships every tensor as one raw buffer.
    def __getstate__(self):
        return {"cols": self._cols, "meta": self.meta}

    def __setstate__(self, state):
        self._cols, self.meta = state["cols"], state["meta"]


def _same(a, b) -> bool:
    if a is b:
        return True
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and \
            a.shape == b.shape and bool(torch.equal(a, b))
    try:
        return bool(a == b)
    except Exception:
        return False
