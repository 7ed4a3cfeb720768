"""Reading a checkpoint never runs code from it.

- The controller's state and every rank's RNG streams are JSON (`dumps`/`loads`): plain values
  as themselves, and what JSON lacks (tuples, bytes, non-string keys, tensors, numpy arrays) as
  tagged objects whose payload is raw bytes, so that every value comes back exactly.
- Pickles that torch.distributed.checkpoint writes itself (`.metadata`) and an older RNGState's
  go through `restricted_load`, which resolves only the globals it is given and
  refuses any other: a crafted file raises instead of calling what it names.
"""
from __future__ import annotations

import base64
import collections
import functools
import io
import json
import pathlib
import pickle
from pathlib import Path

import torch

from .errors import CheckpointError

_TAG = "__hflow__"


# ---------------------------------------------------------------- JSON with exact round trips

def encode(value, where: str = "extra"):
    """`value` as JSON-able data; TypeError naming the entry for a value that has no safe form."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, list):
        return [encode(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, tuple):
        return {_TAG: "tuple", "items": [encode(v, f"{where}[{i}]") for i, v in enumerate(value)]}
    if isinstance(value, dict):
        if all(isinstance(k, str) for k in value) and _TAG not in value:
            return {k: encode(v, f"{where}[{k!r}]") for k, v in value.items()}
        return {_TAG: "dict", "items": [[encode(k, f"{where} key"), encode(v, f"{where}[{k!r}]")]
                                        for k, v in value.items()]}
    if isinstance(value, (bytes, bytearray)):
        return {_TAG: "bytes", "b64": base64.b64encode(bytes(value)).decode()}
    if isinstance(value, torch.Tensor):
        if value.layout != torch.strided or value.is_quantized:
            raise TypeError(f"{where}: only dense tensors can be saved, not {value.layout}")
        cpu = value.detach().to("cpu").contiguous()
        raw = cpu.reshape(-1).view(torch.uint8).numpy().tobytes() if cpu.numel() else b""
        return {_TAG: "tensor", "dtype": str(cpu.dtype).removeprefix("torch."), "shape": list(cpu.shape),
                "b64": base64.b64encode(raw).decode()}
    if type(value).__module__.split(".")[0] == "numpy":
        import numpy as np   # numpy values only reach here when numpy is installed
        if isinstance(value, (np.ndarray, np.generic)):
            array = np.asarray(value)
            if array.dtype.hasobject:
                raise TypeError(f"{where}: a numpy array of Python objects has no safe form")
            return {_TAG: "ndarray" if isinstance(value, np.ndarray) else "npscalar",
                    "dtype": array.dtype.str, "shape": list(array.shape),
                    "b64": base64.b64encode(np.ascontiguousarray(array).tobytes()).decode()}
    raise TypeError(f"{where}: a {type(value).__module__}.{type(value).__qualname__} cannot be saved in a "
                    f"checkpoint (plain values, lists, tuples, dicts, bytes, tensors and numpy arrays can); "
                    f"have state_dict() return plain values")


def decode(data):
    """The inverse of `encode`."""
    if isinstance(data, list):
        return [decode(v) for v in data]
    if not isinstance(data, dict):
        return data
    kind = data.get(_TAG)
    if kind is None:
        return {k: decode(v) for k, v in data.items()}
    if kind == "tuple":
        return tuple(decode(v) for v in data["items"])
    if kind == "dict":
        return {decode(k): decode(v) for k, v in data["items"]}
    if kind == "bytes":
        return base64.b64decode(data["b64"])
    if kind == "tensor":
        dtype = getattr(torch, data["dtype"], None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"unknown tensor dtype {data['dtype']!r}")
        raw = bytearray(base64.b64decode(data["b64"]))
        flat = torch.frombuffer(raw, dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
        return flat.view(dtype).reshape(data["shape"]).clone()
    if kind in ("ndarray", "npscalar"):
        import numpy as np   # only checkpoints that saved numpy values need it
        dtype = np.dtype(data["dtype"])
        if dtype.hasobject:
            raise ValueError("a numpy array of Python objects is not loaded")
        array = np.frombuffer(base64.b64decode(data["b64"]), dtype=dtype).reshape(data["shape"]).copy()
        return array if kind == "ndarray" else array[()]
    raise ValueError(f"unknown tagged value {kind!r}")


def dumps(value, where: str = "extra") -> str:
    return json.dumps(encode(value, where), separators=(",", ":"))


def loads(text: str):
    return decode(json.loads(text))


# ---------------------------------------------------------------- pickles from an allowlist

class Refused(pickle.UnpicklingError):
    """A pickle named a global outside the allowlist."""


def restricted_load(file, allowed: dict, what: str):
    """Unpickle `file` (a binary file object) resolving only `allowed` ((module, name) -> the
    object to use); anything else raises CheckpointError naming `what`, before it is called."""

    class Unpickler(pickle.Unpickler):
        def find_class(self, module, name):
            if (module, name) in allowed:
                return allowed[(module, name)]
            raise Refused(f"{module}.{name}")

        def persistent_load(self, pid):
            raise Refused(f"persistent id {pid!r}")

    try:
        return Unpickler(file).load()
    except Refused as e:
        raise CheckpointError(f"{what}: refused to unpickle {e}, which is not among the types this file holds; "
                              f"the file was not written by hflow / torch.distributed.checkpoint or has been "
                              f"tampered with, and nothing in it was run") from None
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError) as e:
        raise CheckpointError(f"{what}: not a readable pickle ({type(e).__name__}: {e}); the file is damaged") from None


@functools.lru_cache(maxsize=1)
def dcp_metadata_globals() -> dict:
    """(module, name) -> object: every global a DCP `.metadata` pickle refers to."""
    from torch.distributed.checkpoint import filesystem, metadata
    allowed = {("torch.distributed.checkpoint.metadata", name): getattr(metadata, name)
               for name in ("Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata",
                            "ChunkStorageMetadata", "BytesStorageMetadata", "_MEM_FORMAT_ENCODING")
               if hasattr(metadata, name)}
    allowed[("torch.distributed.checkpoint.filesystem", "_StorageInfo")] = filesystem._StorageInfo
    allowed[("torch.serialization", "_get_layout")] = torch.serialization._get_layout
    allowed[("torch", "Size")] = torch.Size
    allowed[("collections", "OrderedDict")] = collections.OrderedDict
    # StorageMeta.checkpoint_id is the Path it was saved to (a plain path: safe to rebuild)
    for module in ("pathlib", "pathlib._local"):
        for name in ("PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"):
            allowed[(module, name)] = pathlib.PurePosixPath if "Posix" in name else pathlib.PureWindowsPath
    allowed.update({("torch", name): obj for name, obj in vars(torch).items() if isinstance(obj, torch.dtype)})
    return allowed


def read_dcp_metadata(path):
    """A DCP directory's `.metadata`, unpickled through the allowlist of DCP's metadata types."""
    file = Path(path) / ".metadata"
    with open(file, "rb") as f:
        return restricted_load(f, dcp_metadata_globals(), str(file))


def _numpy_globals() -> dict:
    try:
        import numpy as np   # older checkpoints pickled numpy's RNG state
    except ImportError:
        return {}
    reconstruct = np.ndarray.__reduce__(np.zeros(0))[0]
    allowed = {("numpy._core.multiarray", "_reconstruct"): reconstruct,
               ("numpy.core.multiarray", "_reconstruct"): reconstruct,
               ("numpy", "ndarray"): np.ndarray, ("numpy", "dtype"): np.dtype}
    for code in ("?", "i1", "i2", "i4", "i8", "u1", "u2", "u4", "u8", "f2", "f4", "f8"):
        cls = type(np.dtype(code))        # numpy 2 gives each dtype its class (UInt32DType, ...)
        allowed[(cls.__module__, cls.__name__)] = cls
    return allowed


def _storage_from_bytes(data: bytes):
    # what pickle.dumps(tensor) stores is a torch.save of the storage: read it without code
    return torch.load(io.BytesIO(data), weights_only=True)


def legacy_rng_blob(data: bytes, what: str):
    """An older RNGState's `pickle.dumps(rng_state())`, read through an allowlist."""
    allowed = {("torch._utils", "_rebuild_tensor_v2"): torch._utils._rebuild_tensor_v2,
               ("torch.storage", "_load_from_bytes"): _storage_from_bytes,
               ("collections", "OrderedDict"): collections.OrderedDict, **_numpy_globals()}
    return restricted_load(io.BytesIO(data), allowed, what)


def weights_only_reason(e: Exception) -> str:
    """The line of torch's long weights_only message that says what was refused."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    for i, line in enumerate(lines):
        if "WeightsUnpickler error" in line:
            return " ".join(lines[i:i + 2] if line.endswith(":") else [line])[:300]
    return (lines or [type(e).__name__])[0][:300]
