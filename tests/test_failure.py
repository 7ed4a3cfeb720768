"""Failures end the whole run, fast and non-zero: a worker exception, a worker SIGKILLed in the
middle of a call, the controller SIGKILLed. Ranks run as plain processes (no torchrun agent to
kill the survivors for us), so these tests see hflow's own failure handling."""
import os
import re

import pytest

from dist import PROGRAMS, run_ranks


SCRIPT = os.path.join(PROGRAMS, "failure_modes.py")


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


@pytest.mark.dist
def test_frozen_worker_is_found_within_30_s_and_named_with_its_last_call(tmp_path):
    """SIGSTOP, default timeouts: the controller's heartbeat finds the frozen rank, names the
    call it was running, SIGKILLs it (same host) and ends the run."""
    run = run_ranks(SCRIPT, 3, args=["stop", 2], tmp_path=tmp_path, timeout=200)
    assert not run.timed_out, run.output
    assert run.returncodes[2] == -9 and all(code != 0 for code in run.returncodes), run.output
    found = max(run.ended_at) - fail_time(run)
    print(f"frozen worker: the run ended {found:.1f} s after the SIGSTOP")
    assert found < 30, run.output
    assert "rank 2 stopped answering" in run.outputs[0], run.output
    assert "its last call: Worker.spin" in run.outputs[0], run.output


@pytest.mark.dist
def test_frozen_controller_is_found_within_30_s(tmp_path):
    """The controller freezes itself (SIGSTOP, heartbeat thread included); default timeouts:
    the workers notice the silence, name their last call, SIGKILL it and exit non-zero."""
    run = run_ranks(SCRIPT, 2, args=["stop", 0], tmp_path=tmp_path, timeout=200)
    assert not run.timed_out, run.output
    assert run.returncodes == [-9, 1], run.output
    found = max(run.ended_at) - fail_time(run)
    print(f"frozen controller: the run ended {found:.1f} s after the SIGSTOP")
    assert found < 30, run.output
    assert "no heartbeat from the controller" in run.outputs[1], run.output
    assert "last call from it: Worker.spin" in run.outputs[1], run.output
