"""Defaults that depend on the model: one value for the embedded default, one for --model.path.

The embedded default (a few-million-parameter model on a toy task, `--model.path` empty) learns
with a large learning rate and answers in a few tokens; a real model wants the usual values
(actor lr ~1e-6, critic ~1e-5, hundreds of new tokens). A recipe's Config writes such a default
as `by_model(embedded, given)`; `--help` shows both, and `hflow.launch` replaces it by the value
for the model in use (`resolve_defaults`) right after parsing the flags.
"""
from __future__ import annotations

import dataclasses


class _ByModel:
    """A default with one value for the embedded default model and one for a model given by
    --model.path. It *is* the embedded value (a float or int subclass), so a recipe that never
    resolves it still runs as before; `resolve_defaults` replaces it by a plain number."""

    def __new__(cls, embedded, given):
        self = super().__new__(cls, embedded)
        self.embedded, self.given = embedded, given
        return self

    def __repr__(self):   # what --help shows as the default
        return f"{self.embedded!r} with the embedded default model, {self.given!r} with --model.path"

    __str__ = __repr__

    def __reduce__(self):
        return by_model, (self.embedded, self.given)


class _ByModelFloat(_ByModel, float):
    pass


class _ByModelInt(_ByModel, int):
    pass


def by_model(embedded: float, given: float):
    """A default that is `embedded` when --model.path is empty and `given` otherwise."""
    return (_ByModelInt if isinstance(embedded, int) else _ByModelFloat)(embedded, given)


def resolve_defaults(cfg):
    """`cfg` (a recipe's Config, with a `model: ModelConfig`) with every `by_model` default
    replaced by its value for the model in use; what a flag set is left as it is. A config
    without a model is returned as it is."""
    if not hasattr(getattr(cfg, "model", None), "path"):
        return cfg
    given = bool(cfg.model.path)

    def resolve(value):
        if isinstance(value, _ByModel):
            return value.given if given else value.embedded
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            return dataclasses.replace(value, **{f.name: resolve(getattr(value, f.name))
                                                 for f in dataclasses.fields(value) if f.init})
        return value

    return resolve(cfg)
