"""A rank SIGKILLed or frozen (SIGSTOP) in each phase of a PPO run: the run ends non-zero within
30 s with no process left behind; a fault between a checkpoint's shard writes and its rename
leaves the last complete checkpoint, and resuming from it gives the straight run's numbers.

The phase is picked by a hook (hflow.faults, HFLOW_FAULT=phase:rank:kill|stop), not a sleep.
Ranks run as plain processes (no torchrun agent cleaning up), so this is hflow's own handling.
"""
import os
import re
import uuid

import pytest

from dist import run_ranks
from test_recipes import RECIPES, rows, small_run, tiny_model, without_timing  # noqa: F401 (fixture)

BOUND_S = 30


def processes_with(marker: str) -> list[int]:
    """Pids of live processes whose environment carries `marker` (a run's, and its children's)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if marker.encode() in f.read():
                    found.append(int(pid))
        except OSError:
            pass
    return found


def faulted_ppo(model, out, fault: str, *extra):
    marker = f"HFLOW_TEST_RUN={uuid.uuid4().hex}"
    run = run_ranks(str(RECIPES / "ppo.py"), 2, args=small_run(model, out, 4, "--algo.critic-warmup", 0, *extra),
                    tmp_path=out.parent, timeout=300,
                    env={"HFLOW_FAULT": fault, marker.split("=")[0]: marker.split("=")[1]})
    return run, marker


@pytest.mark.dist
@pytest.mark.faults
@pytest.mark.parametrize("fault", ["generate:1:kill", "handoff:1:kill", "log_probs:1:kill", "update:1:kill",
                                   "generate:1:stop", "update:1:stop", "log_probs:0:stop"])
def test_a_fault_in_any_phase_ends_the_run_within_the_bound(tiny_model, tmp_path, fault):
    run, marker = faulted_ppo(tiny_model, tmp_path / "out", fault)
    assert not run.timed_out, run.output
    hit = re.search(r"HFLOW_FAULT: rank \d \S+ at \S+ #1 T (\S+)", run.output)
    assert hit, run.output
    assert all(code != 0 for code in run.returncodes), run.output
    took = max(run.ended_at) - float(hit.group(1))
    print(f"{fault}: every rank gone {took:.1f} s after the fault")
    assert took < BOUND_S, run.output
    assert processes_with(marker) == [], "processes left behind"


@pytest.mark.dist
@pytest.mark.faults
def test_a_fault_mid_checkpoint_keeps_the_last_complete_one_and_resume_matches_a_straight_run(tiny_model, tmp_path):
    straight, faulted = tmp_path / "straight", tmp_path / "faulted"
    common = ("--trainer.no-export", "--trainer.save-every", 2)
    run_ranks(str(RECIPES / "ppo.py"), 2, args=small_run(tiny_model, straight, 4, "--algo.critic-warmup", 0, *common),
              tmp_path=tmp_path, timeout=300)
    # the controller dies after step 4's shards are written, before the rename
    run, marker = faulted_ppo(tiny_model, faulted, "checkpoint:0:kill:2", *common)
    assert all(code != 0 for code in run.returncodes) and not run.timed_out, run.output
    assert processes_with(marker) == []
    complete = sorted(p.name for p in (faulted / "checkpoints").iterdir() if re.fullmatch(r"step_\d+", p.name))
    assert complete == ["step_2"], complete                         # step 4 never became a checkpoint
    resumed = run_ranks(str(RECIPES / "ppo.py"), 2, tmp_path=tmp_path, timeout=300,
                        args=small_run(tiny_model, faulted, 4, "--algo.critic-warmup", 0, "--trainer.resume", *common))
    assert resumed.returncodes == [0, 0], resumed.output
    assert sorted(p.name for p in (faulted / "checkpoints").iterdir()) == ["step_2", "step_4"]   # no .tmp left
    a, b = {r["step"]: without_timing(r) for r in rows(straight)}, {r["step"]: without_timing(r) for r in rows(faulted)}
    # same ranks, same flags, same thread counts: the resumed steps are the same computation, so
    # equal to the last bit (a tolerance would hide state that the checkpoint misses)
    for step in (3, 4):
        assert a[step] == b[step], (step, {k: (a[step][k], b[step].get(k)) for k in a[step] if a[step][k] != b[step].get(k)})


@pytest.mark.dist
@pytest.mark.faults
def test_a_run_that_crashed_before_its_first_checkpoint_is_started_again_by_resume(tiny_model, tmp_path):
    """It used to leave metrics with step 0 and nothing else: the same command was refused (an
    earlier run) and so was --trainer.resume (no checkpoint)."""
    out = tmp_path / "out"
    run, _ = faulted_ppo(tiny_model, out, "update:1:kill")
    assert all(code != 0 for code in run.returncodes) and [r["step"] for r in rows(out)] == [0], run.output
    again = run_ranks(str(RECIPES / "ppo.py"), 2, tmp_path=tmp_path, timeout=300,
                      args=small_run(tiny_model, out, 2, "--algo.critic-warmup", 0, "--trainer.resume")).check()
    assert "nothing to resume" in again.output and "starting at step 0" in again.output, again.output
    assert [r["step"] for r in rows(out)] == [0, 1, 2]
