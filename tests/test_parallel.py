"""hflow.parallel.device_of: the device a worker puts a mesh's tensors on, read with APIs every
allowed torch has (no CUDA needed to check the choice)."""
from types import SimpleNamespace

import torch

from hflow import parallel


def test_device_of_a_cpu_mesh_is_the_cpu():
    assert parallel.device_of(SimpleNamespace(device_type="cpu")) == torch.device("cpu")


def test_device_of_a_cuda_mesh_is_the_device_launch_set(monkeypatch):
    monkeypatch.setattr(parallel, "_device", torch.device("cuda", 3))   # as launch does for LOCAL_RANK 3
    assert parallel.device_of(SimpleNamespace(device_type="cuda")) == torch.device("cuda", 3)


def test_device_of_falls_back_to_the_current_cuda_device(monkeypatch):
    monkeypatch.setattr(parallel, "_device", None)                      # a mesh built outside launch
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    assert parallel.device_of(SimpleNamespace(device_type="cuda")) == torch.device("cuda", 1)


import pytest   # noqa: E402


@pytest.mark.parametrize("wanted, local_rank, local_world, devices, expected", [
    ("cpu", 3, 4, 0, "cpu"),
    ("CPU", 0, 1, 8, "cpu"),
    ("cuda", 3, 4, 8, "cuda:3"),            # one process per GPU of the host
    ("gpu", 2, 4, 4, "cuda:2"),
    ("cuda", 5, 8, 1, "cuda:0"),            # one GPU visible per process (Slurm --gpus-per-task)
    ("cuda:1", 0, 1, 2, "cuda:1"),          # a lone process pinned to a GPU
])
def test_pick_device_accepts_the_usual_spellings(wanted, local_rank, local_world, devices, expected):
    assert parallel.pick_device(wanted, local_rank, local_world, devices) == torch.device(expected)


@pytest.mark.parametrize("wanted, local_rank, local_world, devices, message", [
    ("cdua", 0, 1, 1, "use cpu, cuda"),     # a typo no longer runs on the CPU silently
    ("cuda:x", 0, 1, 1, "use cpu, cuda"),
    ("cuda", 0, 2, 0, "sees no CUDA device"),
    ("cuda:0", 0, 2, 2, "pins every rank to one GPU"),
    ("cuda:3", 0, 1, 2, "sees 2 CUDA device"),
    ("cuda", 3, 4, 2, "LOCAL_RANK 3 but this process sees 2"),
])
def test_pick_device_refuses_what_cannot_be_right(wanted, local_rank, local_world, devices, message):
    with pytest.raises((ValueError, RuntimeError), match=message):
        parallel.pick_device(wanted, local_rank, local_world, devices)


ALLOCATE_TWICE = """
import resource, sys, torch
from hflow.parallel import keep_freed_memory_in_the_heap
if sys.argv[1] == "kept":
    assert keep_freed_memory_in_the_heap()
def faults_of_a_fresh_tensor():   # 24 MiB, every page written, as a gathered layer or a gradient is
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    torch.empty(6 << 20).fill_(1.0)
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
faults_of_a_fresh_tensor()
print(min(faults_of_a_fresh_tensor() for _ in range(5)))
"""


@pytest.mark.skipif(not __import__("sys").platform.startswith("linux"), reason="glibc's malloc")
def test_memory_freed_on_cpu_is_reused_without_page_faults():
    """The kernel's count of page faults as the oracle: by default every 24 MiB tensor is mapped
    afresh (~6,000 faults of 4 KiB pages); kept in the heap, the next one reuses it."""
    import subprocess
    import sys

    faults = {how: int(subprocess.run([sys.executable, "-c", ALLOCATE_TWICE, how], capture_output=True, text=True,
                                      check=True, timeout=120).stdout)
              for how in ("default", "kept")}
    assert faults["default"] > 3000, faults
    assert faults["kept"] < 300, faults
