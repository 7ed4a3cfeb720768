"""A checkpoint that runs out of disk: one error that says so (directory, step, free space), no
partial `step_N.tmp` left, and resume from the previous checkpoint works. On a real full file
system: a 1 MiB tmpfs mounted in a private user + mount namespace (`unshare -Urm`)."""
import os
import shutil
import subprocess
import sys

import pytest

from dist import PROGRAMS, free_port


def _tmpfs_disk(tmp_path):
    """An empty directory to mount the tmpfs on; skips when this machine cannot."""
    disk = tmp_path / "disk"
    disk.mkdir()
    if shutil.which("unshare") is None:
        pytest.skip("no unshare(1) on this machine: cannot mount a private size-limited tmpfs")
    probe = subprocess.run(["unshare", "-Urm", "sh", "-c", f"mount -t tmpfs -o size=1m tmpfs {disk}"],
                           capture_output=True, text=True, timeout=30)
    if probe.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs in a user namespace (unshare -Urm): {probe.stderr.strip()[:200]}")
    return disk


def _on_tmpfs(disk, *command, timeout):
    """Run `command` with a 1 MiB tmpfs mounted on `disk` (appended as its last argument)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([PROGRAMS, os.environ.get("PYTHONPATH", "")])}
    run = subprocess.run(["unshare", "-Urm", "sh", "-c", 'mount -t tmpfs -o size=1m tmpfs "$0" && exec "$@" "$0"',
                          str(disk), *map(str, command)], capture_output=True, text=True, timeout=timeout, env=env)
    return run.returncode, run.stdout + run.stderr


def test_a_full_disk_fails_the_save_clearly_and_resume_uses_the_previous_checkpoint(tmp_path):
    disk = _tmpfs_disk(tmp_path)
    code, output = _on_tmpfs(disk, sys.executable, os.path.join(PROGRAMS, "checkpoint_disk_full.py"), timeout=180)
    assert code == 0 and "disk full ok" in output, output


@pytest.mark.dist
def test_a_full_disk_on_one_of_2_ranks_fails_both_saying_so(tmp_path):
    disk = _tmpfs_disk(tmp_path)
    code, output = _on_tmpfs(disk, sys.executable, "-m", "torch.distributed.run", "--nnodes", 1, "--nproc-per-node", 2,
                             "--master-addr", "127.0.0.1", "--master-port", free_port(),
                             os.path.join(PROGRAMS, "checkpoint_disk_full_2ranks.py"), timeout=180)
    assert code == 0 and output.count("disk full ok") == 2, output
