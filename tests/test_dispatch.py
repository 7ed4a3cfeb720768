"""Dispatch modes, padding, tensor-parallel peers, futures that overlap, and per-rank ordering
under 200 interleaved async calls with collectives. Real processes, 2 and 4 ranks."""
import os

import pytest

from dist import PROGRAMS, run_ranks


SCRIPT = os.path.join(PROGRAMS, "dispatch_modes.py")


@pytest.mark.dist
@pytest.mark.parametrize("nproc", [2, 4])
def test_dispatch_modes_futures_and_ordering(tmp_path, nproc):
    run = run_ranks(SCRIPT, nproc, args=[tmp_path], tmp_path=tmp_path, timeout=300).check()
    assert "ALL OK" in run.outputs[0], run.output


@pytest.mark.dist
def test_bench_dispatch_smoke(tmp_path):
    """The benchmark script runs and reports both figures (tiny sizes; figures not checked)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    script = os.path.join(root, "scripts", "bench_dispatch.py")
    run = run_ranks(script, 2, args=["--mib", "2", "--iters", "1", "--calls", "20"],
                    tmp_path=tmp_path, timeout=300).check()
    assert "empty call to a 2-rank group" in run.outputs[0], run.output
    assert "2 MiB Batch split over 2 ranks and gathered back" in run.outputs[0], run.output
