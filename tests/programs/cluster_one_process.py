"""hflow.launch outside torchrun is a world of one; run by test_cluster.py::test_single_process_without_torchrun."""
import torch, hflow
from hflow.runtime.dispatch import dispatch

class Double:
    def __init__(self, mesh):
        assert mesh.mesh.tolist() == [0]

    @dispatch("dp")
    def double(self, batch):
        return hflow.Batch({"y": batch["x"] * 2})

def main(cluster, cfg):
    a, b = cluster.spawn(Double), cluster.spawn(Double)
    x = hflow.Batch({"x": torch.arange(5)})
    assert a.double(x)["y"].tolist() == b.double(x)["y"].tolist() == [0, 2, 4, 6, 8]
    try:
        cluster.spawn(Double, mesh_shape=(1, 2), mesh_dim_names=("dp", "tp"))
    except ValueError as e:
        assert "does not fit the 1 ranks" in str(e), e
    return "ALL OK"

print(hflow.launch(main))
