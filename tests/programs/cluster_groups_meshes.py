"""Groups on disjoint and shared ranks, 1-D/2-D meshes, make_mesh; run by test_cluster.py::test_groups_meshes_and_clean_exit."""
import os, sys, time
import torch, torch.distributed as dist
import hflow
from hflow.distributed.parallel import current_device, make_mesh
from hflow.runtime.dispatch import dispatch
from hflow.placement import split


class Probe:
    """Reports what it was built with and what its mesh looks like from inside."""
    def __init__(self, mesh, tag, *, scale=1):
        self.mesh, self.tag, self.scale = mesh, tag, scale

    @dispatch("all")
    def describe(self):
        groups = {name: dist.get_process_group_ranks(self.mesh.get_group(name))
                  for name in self.mesh.mesh_dim_names}
        return dict(rank=dist.get_rank(), tag=self.tag, scale=self.scale,
                    coordinate=self.mesh.get_coordinate(), groups=groups,
                    mesh=self.mesh.mesh.tolist(), device=str(current_device()))

    @dispatch("all")
    def reduce(self, dim):
        # every rank contributes 2**rank, so each sum names exactly who took part
        t = torch.tensor([2.0 ** dist.get_rank()])
        dist.all_reduce(t, group=self.mesh.get_group(dim))
        return int(t.item())

    @dispatch("all")
    def build_mesh(self, rank_array, names, flag_file):
        m = make_mesh(rank_array, names)
        assert make_mesh(rank_array, names) is m     # cached: no second group creation
        sums = {}
        for name in names:
            t = torch.tensor([2.0 ** dist.get_rank()])
            dist.all_reduce(t, group=m.get_group(name))
            sums[name] = int(t.item())
        open(flag_file + f".{dist.get_rank()}", "w").close()
        return dict(coordinate=m.get_coordinate(), sums=sums)

    @dispatch("all")
    def wait_for(self, flag_file, ranks):
        # blocks until the other ranks' make_mesh finished: proves it did not need us
        deadline = time.time() + 60
        while not all(os.path.exists(flag_file + f".{r}") for r in ranks):
            assert time.time() < deadline, "make_mesh on the other ranks never finished"
            time.sleep(0.01)
        return True

    def plain(self):
        return "not remote"


def bits(ranks):
    return sum(2 ** r for r in ranks)


def main(cluster, tmp):
    n = cluster.world_size
    plan = split([["left"], ["right"]], n)
    everyone = cluster.spawn(Probe, "all", scale=3)
    left = cluster.spawn(Probe, "left", ranks=plan["left"])
    right = cluster.spawn(Probe, "right", ranks=plan["right"])
    shared = cluster.spawn(Probe, "shared")                     # same layout as `everyone`

    # constructor got the mesh first, then args and kwargs
    d = everyone.describe()
    assert [x["rank"] for x in d] == list(range(n))
    assert all(x["tag"] == "all" and x["scale"] == 3 and x["device"] == "cpu" for x in d)
    assert [x["coordinate"] for x in d] == [(r,) for r in range(n)]
    assert all(x["groups"]["dp"] == list(range(n)) for x in d)
    assert [x["rank"] for x in left.describe()] == plan["left"]
    assert [x["rank"] for x in right.describe()] == plan["right"]

    # collectives stay inside each group, on disjoint and shared ranks, overlapped
    futures = [g.reduce.future("dp") for g in (everyone, left, right, shared)]
    results = [f.result() for f in futures]
    assert results[0] == [bits(range(n))] * n and results[3] == results[0]
    assert results[1] == [bits(plan["left"])] * len(plan["left"])
    assert results[2] == [bits(plan["right"])] * len(plan["right"])

    # a spawn while calls are queued on a subset: group creation waits its turn everywhere
    queued = [left.reduce.future("dp") for _ in range(5)]
    if n == 4:
        grid = cluster.spawn(Probe, "grid", mesh_shape=(2, 2), mesh_dim_names=("dp", "tp"))
        g = grid.describe()
        assert [x["coordinate"] for x in g] == [(0, 0), (0, 1), (1, 0), (1, 1)]
        assert [x["groups"]["tp"] for x in g] == [[0, 1], [0, 1], [2, 3], [2, 3]]
        assert [x["groups"]["dp"] for x in g] == [[0, 2], [1, 3], [0, 2], [1, 3]]
        assert grid.reduce("tp") == [3, 3, 12, 12] and grid.reduce("dp") == [5, 10, 5, 10]
    else:
        grid = cluster.spawn(Probe, "grid", mesh_shape=(1, 2), mesh_dim_names=("dp", "tp"))
        assert grid.reduce("tp") == [3, 3] and grid.reduce("dp") == [1, 2]
    assert [f.result() for f in queued] == [[bits(plan["left"])] * len(plan["left"])] * 5

    # a group on the last rank alone: that rank now belongs to one more process group than
    # the others, which is what breaks torch's default naming of locally created groups
    lonely = cluster.spawn(Probe, "lonely", ranks=[n - 1])
    assert lonely.reduce("dp") == [2 ** (n - 1)]

    # make_mesh inside a method, by its ranks alone: the right half waits on a file that the
    # left half writes only after building and using its mesh
    flag = os.path.join(tmp, "made")
    wait = right.wait_for.future(flag, plan["left"]) if n > 1 else None
    if n == 4:
        made = left.build_mesh([[0], [1]], ("dp", "tp"), flag)
        assert [m["coordinate"] for m in made] == [(0, 0), (1, 0)]
        assert [m["sums"] for m in made] == [{"dp": 3, "tp": 1}, {"dp": 3, "tp": 2}]
    else:
        made = left.build_mesh([0], ("tp",), flag)
        assert made == [{"coordinate": (0,), "sums": {"tp": 1}}]
    assert wait is None or wait.result() == [True] * len(plan["right"])
    # ... and a strided 2-D generation mesh over all ranks (tp groups strided, as reshard wants)
    if n == 4:
        gen = everyone.build_mesh([[0, 2], [1, 3]], ("dp_g", "tp_g"), flag + "2")
        assert [m["sums"]["tp_g"] for m in gen] == [5, 10, 5, 10]
        assert [m["sums"]["dp_g"] for m in gen] == [3, 3, 12, 12]
    else:
        gen = everyone.build_mesh([[0, 1]], ("dp_g", "tp_g"), flag + "2")
        assert [m["sums"] for m in gen] == [{"dp_g": 1, "tp_g": 3}, {"dp_g": 2, "tp_g": 3}], gen
    # the same rank set again from a different group, after more groups exist: still agrees
    again = everyone.build_mesh(list(range(n)), ("x",), flag + "3")
    assert [m["sums"]["x"] for m in again] == [bits(range(n))] * n

    try:
        everyone.plain
        raise AssertionError("an undecorated method must not be callable")
    except AttributeError as e:
        assert "@dispatch(" in str(e)
    print(repr(everyone), flush=True)
    return "ALL OK"


if __name__ == "__main__":
    out = hflow.launch(main, sys.argv[1])
    if out is not None:
        print(out, flush=True)
