"""launch + spawn: groups on disjoint and shared ranks, 1-D and 2-D meshes, make_mesh inside a
worker method, placement plans, clean exit. Real processes, 2 and 4 ranks."""
import os
import subprocess
import sys

import pytest

from dist import run_ranks, torchrun
from hflow.placement import colocate, split

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SCRIPT = r'''
import os, sys, time
import torch, torch.distributed as dist
import hflow
from hflow.parallel import current_device, make_mesh
from hflow.dispatch import dispatch
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
'''


@pytest.mark.dist
@pytest.mark.parametrize("nproc", [2, 4])
def test_groups_meshes_and_clean_exit(tmp_path, nproc):
    run = run_ranks(SCRIPT, nproc, args=[tmp_path], tmp_path=tmp_path, timeout=300).check()
    assert "ALL OK" in run.outputs[0], run.output
    assert "WorkerGroup Probe mesh" in run.outputs[0]


ONE = r'''
import torch, hflow
from hflow.dispatch import dispatch

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
'''


def test_single_process_without_torchrun(tmp_path):
    """launch outside torchrun is a world of one (handy for debugging a recipe)."""
    path = tmp_path / "one.py"
    path.write_text(ONE)
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    proc = subprocess.run([sys.executable, str(path), str(tmp_path)], capture_output=True,
                          text=True, timeout=300, env={**env, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0 and "ALL OK" in proc.stdout, proc.stdout + proc.stderr


@pytest.mark.dist
def test_example_recipe_under_torchrun(tmp_path):
    """The README's main-job command, shrunk: two split groups and a colocated one."""
    run = torchrun(os.path.join(ROOT, "recipes", "example.py"), nproc=4,
                   args=["--steps", "30"], tmp_path=tmp_path, timeout=300).check()
    assert "example: done" in run.output, run.output


def test_placement_plans():
    assert colocate(["actor", "critic"], 3) == {"actor": [0, 1, 2], "critic": [0, 1, 2]}
    plan = split([["actor", "ref"], "critic"], 4)
    assert plan == {"actor": [0, 1], "ref": [0, 1], "critic": [2, 3]}
    assert plan.roles_on(1) == ["actor", "ref"]
    assert split([["actor"], ["critic"], ["reward"]], 4) == \
        {"actor": [0, 1], "critic": [2], "reward": [3]}
    assert split(["actor", "critic"], 8, sizes=[6, 2])["critic"] == [6, 7]
    assert split(["actor", "critic"], 1) == {"actor": [0], "critic": [0]}   # falls back
    with pytest.raises(ValueError, match="add up to 4"):
        split(["actor", "critic"], 4, sizes=[1, 2])
    with pytest.raises(ValueError, match="two sets"):
        split([["actor"], ["actor"]], 4)


RELEASE = r'''
import sys, torch, hflow
from hflow.dispatch import dispatch
from hflow.workers import Actor, ActorConfig, RolloutConfig
from test_fsdp import random_rollouts


class Memory:
    def __init__(self, mesh):
        pass

    @dispatch("all")
    def resident_bytes(self):
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * 4096


def pg_loss(logp, mb, entropy=None):
    return -(logp * mb["advantages"] * mb["response_mask"]).sum() / mb["response_mask"].sum(), {}


def used_actor(cluster, path):
    actor = cluster.spawn(Actor, ActorConfig(model_path=path))
    actor.generate(hflow.Batch({"prompt_ids": [[5, 6, 7]] * 4}), RolloutConfig(n=2, max_tokens=4))
    actor.update(hflow.Batch(random_rollouts(4, 2, 1000, seed=0)), pg_loss)
    return actor


def main(cluster, path):
    memory = cluster.spawn(Memory)
    used_actor(cluster, path).close()   # the first one also loads code and warms up allocators
    before = memory.resident_bytes()
    actor = used_actor(cluster, path)
    used = memory.resident_bytes()
    actor.close()
    after = memory.resident_bytes()
    for rank, (b, u, a) in enumerate(zip(before, used, after)):
        print(f"rank {rank}: {b / 2**20:.0f} MiB -> {u / 2**20:.0f} MiB in use -> {a / 2**20:.0f} MiB after close")
        assert u - b > 40 * 2**20, "the actor should hold its shards, optimizer state and engine"
        assert a - b < 0.2 * (u - b), "close() should give back what the actor held"
    try:
        actor.log_probs(hflow.Batch(random_rollouts(2, 1, 1000, seed=1)))
    except RuntimeError as e:
        assert "released" in str(e), e
        return "ALL OK"
    raise AssertionError("a call on a released group must raise")

print(hflow.launch(main, sys.argv[1]))
'''


@pytest.mark.dist
def test_close_frees_the_workers_memory_and_later_calls_raise(tmp_path):
    from test_fsdp import TESTS_ENV, tiny_model_dir
    path = tiny_model_dir(tmp_path / "model", vocab=1000, hidden=256, layers=4)
    run = torchrun(RELEASE, nproc=2, args=[path], tmp_path=tmp_path, timeout=300, env=TESTS_ENV).check()
    assert "ALL OK" in run.output, run.output
