"""Ctrl-C and SIGTERM end a run with one message after saving the step in progress, and the run
continues from there; the embedded default's warm-up too.

The signals are real: the terminal's Ctrl-C is a SIGINT to torchrun's whole process group (every
rank gets it, and torchrun forwards it again), a scheduler's SIGTERM goes to torchrun alone.
"""
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dist import PROGRAMS, device, free_port, run_ranks
from test_recipes import RECIPES, rows, small_run, tiny_model  # noqa: F401 (fixture)

from hflow.runtime import stopping


def test_the_first_signal_asks_a_second_ctrl_c_later_stops_at_once(monkeypatch, capsys):
    old = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        stopping.install()
        assert stopping.requested() is None
        os.kill(os.getpid(), signal.SIGTERM)
        assert stopping.requested() == signal.SIGTERM
        os.kill(os.getpid(), signal.SIGINT)     # torchrun's forwarded copy: the same request
        assert stopping.requested() == signal.SIGTERM
        assert capsys.readouterr().err.count("stopping after the step in progress") == 1
        monkeypatch.setattr(stopping, "SAME_REQUEST_S", 0.0)
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.1)
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)


def start_torchrun(args, out: Path, nproc=2):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", str(nproc),
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()), str(RECIPES / "ppo.py"), *map(str, args)]
    log = open(out.parent / f"{out.name}.log", "w+")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "HFLOW_DEVICE": device()}
    # a session of its own: the test signals its process group as a terminal would, not pytest's
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True), log


def wait_for_step(proc, out: Path, step: int, timeout=240):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        if (out / "metrics.jsonl").exists() and any(r["step"] >= step for r in rows(out)):
            return
        time.sleep(0.05)
    raise AssertionError(f"the run did not reach step {step} (exit {proc.poll()})")


def ended_within(proc, log, seconds) -> str:
    try:
        proc.wait(timeout=seconds)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        log.seek(0)
        raise AssertionError(f"still running {seconds} s after the signal:\n{log.read()}")
    log.seek(0)
    return log.read()


@pytest.mark.dist
@pytest.mark.parametrize("how", ["ctrl-c", "sigterm"])
def test_a_stopped_run_saves_its_step_says_so_once_and_resumes(tiny_model, tmp_path, how):
    out = tmp_path / "out"
    args = small_run(tiny_model, out, 40, "--algo.critic-warmup", 0)   # --trainer.save-every 0: the default
    proc, log = start_torchrun(args, out)
    wait_for_step(proc, out, 2)
    if how == "ctrl-c":
        os.killpg(proc.pid, signal.SIGINT)    # what the terminal does
        name = "SIGINT"
    else:
        os.kill(proc.pid, signal.SIGTERM)     # what a scheduler does to torchrun
        name = "SIGTERM"
    sent = time.monotonic()
    output = ended_within(proc, log, 30)
    took = time.monotonic() - sent
    stops = re.findall(rf"hflow: stopped by {name} after step (\d+) of 40, saved in (\S+); "
                       r"continue with the same command and --trainer.resume", output)
    assert len(stops) == 1, output
    step = int(stops[0][0])
    assert (out / "checkpoints" / f"step_{step}").is_dir(), output
    assert [r["step"] for r in rows(out)][-1] == step
    # the ranks' own tracebacks are gone; torchrun's agent still prints its SignalException
    assert "KeyboardInterrupt" not in output and "RuntimeError" not in output, output
    print(f"{how}: ended {took:.1f} s after the signal, at step {step}")

    resumed = run_ranks(str(RECIPES / "ppo.py"), 2, tmp_path=tmp_path, timeout=300,
                        args=small_run(tiny_model, out, step + 1, "--algo.critic-warmup", 0, "--trainer.resume"))
    resumed.check()
    assert f"resumed from step {step}" in resumed.output
    assert [r["step"] for r in rows(out)] == list(range(step + 2))


@pytest.mark.dist
def test_an_interrupted_warm_up_continues_where_it_stopped_and_ends_as_a_straight_one(tmp_path):
    program = os.path.join(PROGRAMS, "warm_up_interrupted.py")
    cut = run_ranks(program, 1, args=[tmp_path / "cut", 25], tmp_path=tmp_path, timeout=300,
                    env={"HFLOW_FAULT": "update:0:int:10"})
    assert cut.returncodes == [130], cut.output
    assert cut.output.count("hflow: stopped by SIGINT during the warm-up") == 1, cut.output
    assert "after sft step 10" in cut.output and "Traceback" not in cut.output, cut.output
    again = run_ranks(program, 1, args=[tmp_path / "cut", 25], tmp_path=tmp_path, timeout=300).check()
    assert "continuing the interrupted warm-up from sft step 10" in again.output, again.output
    straight = run_ranks(program, 1, args=[tmp_path / "straight", 25], tmp_path=tmp_path, timeout=300).check()
    built = [re.search(r"warm-up done: (\S+)", r.output).group(1) for r in (again, straight)]
    assert not list((tmp_path / "cut").glob("*.partial")), "the saved warm-up is removed once it is built"
    weights = [(Path(b) / "model.safetensors").read_bytes() for b in built]
    assert weights[0] == weights[1]


@pytest.mark.dist
def test_a_stopped_sft_run_exports_the_model_it_has(tmp_path):
    out = tmp_path / "sft"
    run = run_ranks(str(RECIPES / "sft.py"), 1, tmp_path=tmp_path, timeout=300,
                    env={"HFLOW_FAULT": "update:0:int:3"},
                    args=["--model.default-size", "tiny", "--output-dir", out, "--steps", 50,
                          "--data.batch-size", 8, "--eval-size", 8])
    assert run.returncodes == [130], run.output
    assert run.output.count("hflow: stopped by SIGINT after sft step 3") == 1, run.output
    assert (out / "model" / "config.json").exists()
