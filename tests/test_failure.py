"""Failures end the whole run, fast and non-zero: a worker exception, a worker SIGKILLed in the
middle of a call, the controller SIGKILLed. Ranks run as plain processes (no torchrun agent to
kill the survivors for us), so these tests see hflow's own failure handling."""
import re

import pytest

from dist import run_ranks

SCRIPT = r'''
import os, signal, sys, time
import torch, torch.distributed as dist
import hflow
from hflow.dispatch import dispatch


class Worker:
    def __init__(self, mesh):
        self.mesh = mesh

    @dispatch("all")
    def pid(self):
        return os.getpid()

    @dispatch("all")
    def fail_on(self, bad_rank):
        if dist.get_rank() == bad_rank:
            raise ValueError(f"bad input on purpose")
        t = torch.ones(1)
        dist.all_reduce(t, group=self.mesh.get_group())   # the others wait here, forever
        return t.item()

    @dispatch("all")
    def spin(self):
        while True:                                        # a long call full of collectives
            dist.all_reduce(torch.ones(1), group=self.mesh.get_group())
            time.sleep(0.01)


def main(cluster, cfg):
    mode, victim = sys.argv[1], int(sys.argv[2])
    group = cluster.spawn(Worker)
    pids = group.pid()
    print(f"T_FAIL {time.time()}", flush=True)
    if mode == "raise":
        try:
            group.fail_on(victim)
        except hflow.RemoteError as e:
            assert e.rank == victim and "bad input on purpose" in e.remote_traceback
            print(f"CAUGHT {e}", flush=True)
        try:                      # the run is failed now: later calls refuse at once
            group.pid()
        except hflow.RemoteError as e:
            print(f"REFUSED rank {e.rank}", flush=True)
        return "returned normally"                 # ...and the exit is non-zero anyway
    pending = group.spin.future()
    time.sleep(0.5)
    os.kill(pids[victim], signal.SIGKILL)
    pending.result()


if __name__ == "__main__":
    print(hflow.launch(main), flush=True)
'''


def fail_time(run) -> float:
    return float(re.search(r"T_FAIL (\S+)", run.outputs[0]).group(1))


@pytest.mark.dist
@pytest.mark.parametrize("nproc", [2, 4])
def test_worker_exception_reaches_controller_and_ends_every_rank(tmp_path, nproc):
    victim = nproc - 1
    run = run_ranks(SCRIPT, nproc, args=["raise", victim], tmp_path=tmp_path, timeout=200)
    assert not run.timed_out, run.output
    assert all(code != 0 for code in run.returncodes), run.output
    assert max(run.ended_at) - fail_time(run) < 60, run.output
    controller = run.outputs[0]
    assert f"CAUGHT Worker.fail_on failed on rank {victim}" in controller, run.output
    assert "in fail_on" in controller and "ValueError: bad input on purpose" in controller
    assert f"REFUSED rank {victim}" in controller
    assert "a worker call failed earlier" in controller


@pytest.mark.dist
@pytest.mark.parametrize("nproc", [2, 4])
def test_worker_sigkilled_mid_call_ends_the_run(tmp_path, nproc):
    victim = nproc - 1
    run = run_ranks(SCRIPT, nproc, args=["kill", victim], tmp_path=tmp_path, timeout=200)
    assert not run.timed_out, run.output
    assert run.returncodes[victim] == -9
    assert all(code != 0 for code in run.returncodes), run.output
    assert max(run.ended_at) - fail_time(run) < 120, run.output
    assert f"failed on rank {victim}" in run.outputs[0], run.output


@pytest.mark.dist
def test_controller_sigkilled_mid_call_ends_the_run(tmp_path):
    """The workers notice the controller's heartbeat stopping (timeout shortened here)."""
    run = run_ranks(SCRIPT, 2, args=["kill", 0], tmp_path=tmp_path, timeout=200,
                    env={"HFLOW_CONTROLLER_TIMEOUT_S": "3"})
    assert not run.timed_out, run.output
    assert run.returncodes == [-9, 1], run.output
    assert max(run.ended_at) - fail_time(run) < 60, run.output
    assert "no heartbeat from the controller" in run.outputs[1]
