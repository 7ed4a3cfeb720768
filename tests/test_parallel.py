"""hflow.distributed.parallel.device_of: the device a worker puts a mesh's tensors on, read with APIs every
allowed torch has (no CUDA needed to check the choice)."""
from types import SimpleNamespace

import torch

from hflow.distributed import parallel


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
