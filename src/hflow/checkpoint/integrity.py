"""A checkpoint's manifest: the size and sha256 of every file, written into `step_N.tmp` last,
before the rename, and checked before a checkpoint is loaded.

    manifest.json   {"format": 1, "step": 4, "files": {"actor/__0_0.distcp": {"size": .., "sha256": ..}, ..}}

Shards are hashed by the rank that wrote them, right after writing (the bytes are still in the
page cache, and ranks hash in parallel); whatever no rank reported, the manifest's writer hashes.
Checking compares sizes first (a truncated or missing file costs a stat) and then the hashes, on a
few threads (hashlib releases the GIL on large buffers).
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path, PurePosixPath

from .errors import CheckpointError, where

MANIFEST = "manifest.json"
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_CHUNK = 4 << 20


def hash_file(path) -> dict:
    """{"size", "sha256"} of a file, read in chunks."""
    digest, size = hashlib.sha256(), 0
    buffer = bytearray(_CHUNK)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buffer):
            digest.update(view[:n])
            size += n
    return {"size": size, "sha256": digest.hexdigest()}


def _threads(n_files: int) -> int:
    return max(1, min(8, os.cpu_count() or 1, n_files))


def _hash_all(root: Path, names: list[str]) -> dict[str, dict]:
    with ThreadPoolExecutor(_threads(len(names))) as pool:
        return dict(zip(names, pool.map(lambda name: hash_file(root / name), names)))


def files_under(path) -> list[str]:
    """Every file below `path`, as sorted relative POSIX paths (the manifest itself left out)."""
    path = Path(path)
    return sorted(p.relative_to(path).as_posix() for p in path.rglob("*")
                  if p.is_file() and p.relative_to(path).as_posix() != MANIFEST)


def write_manifest(path, step: int, reported: dict[str, dict] | None = None) -> Path:
    """Write `<path>/manifest.json` for every file under `path`. `reported`: entries already hashed
    (relative path -> {"size", "sha256"}), trusted when the file's size still matches; the rest
    are hashed here. One process, after every file is written."""
    path = Path(path)
    reported = reported or {}
    names = files_under(path)
    missing = sorted(set(reported) - set(names))
    if missing:
        raise CheckpointError(f"checkpoint {where(path)}: {', '.join(missing)} reported written but not there; "
                              f"is the checkpoint directory on a file system every rank shares?")
    todo = [n for n in names if reported.get(n, {}).get("size") != (path / n).stat().st_size]
    files = {n: reported[n] for n in names if n not in todo} | _hash_all(path, todo)
    text = json.dumps({"format": 1, "step": step, "files": {n: files[n] for n in names}}, indent=1)
    part = path / (MANIFEST + ".part")
    with open(part, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(part, path / MANIFEST)
    return path / MANIFEST


def read_manifest(path) -> dict | None:
    """The manifest's files (relative path -> entry), None when the checkpoint has none (written
    before hflow kept one); CheckpointError when it is unreadable or not a manifest."""
    try:
        return _manifest_files(Path(path) / MANIFEST)
    except ValueError as e:
        raise CheckpointError(f"checkpoint {where(path)}: {MANIFEST} is unreadable ({e})") from None



def _manifest_files(file: Path) -> dict | None:
    """What `read_manifest` returns; ValueError saying what is wrong with it (zeroed bytes, or
    JSON of another shape: a resume must see a damaged checkpoint there, not crash)."""
    if not file.exists():
        return None
    try:
        manifest = json.loads(file.read_text())
    except OSError as e:
        raise ValueError(str(e)) from None
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if not isinstance(files, dict):
        raise ValueError('not a JSON object with a "files" mapping')
    for name, entry in files.items():
        parts = PurePosixPath(name).parts
        if not parts or parts[0] == "/" or ".." in parts:
            raise ValueError(f"it names {name!r}, outside the checkpoint")
        if not (isinstance(entry, dict) and type(entry.get("size")) is int and entry["size"] >= 0
                and isinstance(entry.get("sha256"), str) and _SHA256.match(entry["sha256"])):
            raise ValueError(f"the entry of {name} is not a size and a sha256")
    return files


def verify(path) -> list[str] | None:
    """Problems of the checkpoint at `path` against its manifest, one line per damaged file (an
    unreadable manifest, a file it does not list, too) ([] when it verifies); None when it has no
    manifest."""
    path = Path(path)
    try:
        files = _manifest_files(path / MANIFEST)
    except ValueError as e:
        return [f"{MANIFEST} is unreadable ({e})"]
    if files is None:
        return None
    # a manifest that leaves out what is there was not written for these files
    problems = [f"{name} is not listed in {MANIFEST}" for name in files_under(path) if name not in files]
    to_hash = []
    for name in sorted(files):
        file = path / name
        if not file.is_file():
            problems.append(f"{name} is missing")
            continue
        size, want = file.stat().st_size, files[name]["size"]
        if size < want:
            problems.append(f"{name} is truncated ({size} of {want} bytes)")
        elif size > want:
            problems.append(f"{name} is longer than written ({size}, not {want} bytes)")
        else:
            to_hash.append(name)
    for name, got in _hash_all(path, to_hash).items():
        if got["sha256"] != files[name]["sha256"]:
            problems.append(f"{name} has changed bytes (its sha256 differs from the manifest's)")
    return problems


def check_dcp_extents(path, metadata) -> list[str]:
    """What a DCP directory's `.metadata` says must be there and is not: a missing shard file, or
    one shorter than the bytes it is to be read from. A stat per file; no manifest needed."""
    path = Path(path)
    need: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        need[info.relative_path] = max(need.get(info.relative_path, 0), info.offset + info.length)
    problems = []
    for name, end in sorted(need.items()):
        file = path / name
        if not file.is_file():
            problems.append(f"{file} is missing")
        elif file.stat().st_size < end:
            problems.append(f"{file} is truncated ({file.stat().st_size} bytes; its records end at byte {end})")
    return problems


def warn_unverified(path) -> None:
    """The one line for a checkpoint saved before hflow wrote manifests."""
    print(f"hflow: warning: checkpoint {where(path)} has no {MANIFEST} (saved by an older hflow): "
          f"loading it without checking its files", file=sys.stderr, flush=True)
