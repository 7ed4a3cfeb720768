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
