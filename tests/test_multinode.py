"""Two torchrun "nodes" on this machine run a recipe together and get the single-node numbers;
a single-node run listens on loopback only."""
import os
import re
import subprocess
import sys

import pytest

from dist import PROGRAMS, free_port, torchrun
from test_recipes import RECIPES, rows, small_run, tiny_model, without_timing  # noqa: F401 (fixture)


def two_nodes(script: str, args, timeout: float = 400) -> list[subprocess.CompletedProcess]:
    """`torchrun --nnodes 2 --node-rank i --rdzv-endpoint 127.0.0.1:PORT`, one rank per node,
    started as two separate launches the way two hosts would start them."""
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "HFLOW_DEVICE": "cpu"}
    launches = [subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(i),
         "--nproc-per-node", "1", "--rdzv-endpoint", f"127.0.0.1:{port}", script, *map(str, args)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env) for i in range(2)]
    done = []
    try:
        for launch in launches:
            out, _ = launch.communicate(timeout=timeout)
            done.append(subprocess.CompletedProcess(launch.args, launch.returncode, out))
    finally:
        for launch in launches:
            launch.kill()
    return done


@pytest.mark.dist
def test_two_nodes_run_ppo_to_the_single_node_numbers(tiny_model, tmp_path):
    one_node, two = tmp_path / "one_node", tmp_path / "two_nodes"
    torchrun(str(RECIPES / "ppo.py"), 2, small_run(tiny_model, one_node, 2, "--algo.critic-warmup", 0),
             timeout=400).check()
    launches = two_nodes(str(RECIPES / "ppo.py"), small_run(tiny_model, two, 2, "--algo.critic-warmup", 0))
    for launch in launches:
        assert launch.returncode == 0, launch.stdout
    assert [without_timing(r) for r in rows(two)] == [without_timing(r) for r in rows(one_node)]


@pytest.mark.dist
def test_a_single_node_run_listens_on_loopback_only(tmp_path):
    run = torchrun(os.path.join(PROGRAMS, "listening_sockets.py"), 2, timeout=200).check()
    lines = re.findall(r"RANK (\d) GLOO (\S+) TP (\S+) LISTENS (.*)", run.output)
    assert len(lines) == 2, run.output
    for rank, gloo, tp, addresses in lines:
        assert (gloo, tp) == ("lo", "lo"), run.output
        assert addresses.split(), run.output   # gloo and RPC do listen...
        assert all(a.startswith("127.") or a == "::1" for a in addresses.split()), run.output   # ...on loopback


@pytest.mark.dist
def test_two_nodes_keep_the_default_interfaces(tmp_path):
    launches = two_nodes(os.path.join(PROGRAMS, "listening_sockets.py"), [], timeout=200)
    for launch in launches:
        assert launch.returncode == 0, launch.stdout
    assert "GLOO None TP None" in launches[0].stdout, launches[0].stdout
