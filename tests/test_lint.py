"""The tree passes ruff's checks for bugs (pyproject.toml [tool.ruff]: pyflakes' undefined names,
unused imports and variables, redefinitions, and syntax errors) — in the test command, so CI runs it."""
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_ruff_finds_nothing():
    if subprocess.run([sys.executable, "-m", "ruff", "--version"], capture_output=True).returncode != 0:
        pytest.fail("ruff is not installed: it is in the test extra, pip install -e '.[test]'")
    run = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "."], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
