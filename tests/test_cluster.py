"""launch + spawn: groups on disjoint and shared ranks, 1-D and 2-D meshes, make_mesh inside a
worker method, placement plans, clean exit. Real processes, 2 and 4 ranks."""
import os
import subprocess
import sys

import pytest

from dist import PROGRAMS, run_ranks, torchrun
from hflow.placement import colocate, split

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SCRIPT = os.path.join(PROGRAMS, "cluster_groups_meshes.py")


@pytest.mark.dist
@pytest.mark.parametrize("nproc", [2, 4])
def test_groups_meshes_and_clean_exit(tmp_path, nproc):
    run = run_ranks(SCRIPT, nproc, args=[tmp_path], tmp_path=tmp_path, timeout=300).check()
    assert "ALL OK" in run.outputs[0], run.output
    assert "WorkerGroup Probe mesh" in run.outputs[0]


ONE = os.path.join(PROGRAMS, "cluster_one_process.py")


def test_single_process_without_torchrun(tmp_path):
    """launch outside torchrun is a world of one (handy for debugging a recipe)."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    proc = subprocess.run([sys.executable, ONE, str(tmp_path)], capture_output=True,
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


RELEASE = os.path.join(PROGRAMS, "cluster_release.py")


@pytest.mark.dist
def test_close_frees_the_workers_memory_and_later_calls_raise(tmp_path):
    from test_fsdp import TESTS_ENV, tiny_model_dir
    path = tiny_model_dir(tmp_path / "model", vocab=1000, hidden=256, layers=4)
    run = torchrun(RELEASE, nproc=2, args=[path], tmp_path=tmp_path, timeout=300, env=TESTS_ENV).check()
    assert "ALL OK" in run.output, run.output
