"""The directories of a checkpoint root: `step_N` (complete), `step_N.tmp` (a save in progress or
one that failed), and the rename between them that commits a save; and the run's output
directory around the root (`<output_dir>/checkpoints`), checked before a run starts."""
from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

_STEP_DIR = re.compile(r"^step_(\d+)$")
_TMP_DIR = re.compile(r"^step_(\d+)\.tmp$")
_OLD_DIR = re.compile(r"^(step_\d+)\.old$")
_DELETING_DIR = re.compile(r"^step_\d+(\.old)?\.deleting$")


def checkpoint_dir(root, step: int) -> Path:
    return Path(root) / f"step_{step}"


def temporary_dir(root, step: int) -> Path:
    return Path(root) / f"step_{step}.tmp"


def checkpoint_step(path) -> int:
    """The step of a `step_N` directory."""
    match = _STEP_DIR.match(Path(path).name)
    if match is None:
        raise ValueError(f"{path} is not a checkpoint directory (expected a name like step_12)")
    return int(match.group(1))


def list_checkpoints(root) -> list[Path]:
    """Complete checkpoints under `root`, oldest first (`.tmp` and other names ignored)."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and _STEP_DIR.match(p.name)]
    return sorted(found, key=checkpoint_step)


def latest_checkpoint(root) -> Path | None:
    """The complete checkpoint with the highest step, or None."""
    found = list_checkpoints(root)
    return found[-1] if found else None


def prune_stale(root) -> list[Path]:
    """Finish what an interrupted save left, before a save begins and at resume (while nothing is
    saving): a `step_N.old` without its `step_N` is renamed back (the save of a step already there
    died between `commit`'s two renames, so that step is still the old one); every `step_N.tmp`,
    a `step_N.old` beside its `step_N` and what a removal cut short (`*.deleting`) are removed (no
    save will finish them, and their partial files would hold the disk space the next save
    needs). Returns what was removed."""
    root = Path(root)
    if not root.is_dir():
        return []
    _restore_moved_aside(root)
    removed = []
    for path in list(root.iterdir()):
        if _TMP_DIR.match(path.name) or _DELETING_DIR.match(path.name):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
        elif _OLD_DIR.match(path.name):
            _discard(path)
            removed.append(path)
    return removed


def _restore_moved_aside(root: Path) -> None:
    for path in list(root.iterdir()):
        old = _OLD_DIR.match(path.name)
        if old and not (root / old.group(1)).exists():
            os.rename(path, root / old.group(1))
            fsync_dir(root)


def begin_save(root, step: int) -> Path:
    """Make an empty `step_N.tmp`, clearing what earlier saves left (see `prune_stale`). One
    process."""
    prune_stale(root)
    tmp = temporary_dir(root, step)
    tmp.mkdir(parents=True)
    return tmp


def commit(root, step: int, keep_last: int | None = None) -> Path:
    """Rename `step_N.tmp` to `step_N` once everything is written; keep it and the `keep_last - 1`
    checkpoints before it (newer steps are left alone).

    Call on one process, after every rank's save returned. That rename is the commit. An existing
    `step_N` (a run resumed from an earlier step) is replaced: it is moved aside to `step_N.old`
    first, which `prune_stale` renames back if the process dies before `step_N.tmp` takes its name.
    """
    tmp, final = temporary_dir(root, step), checkpoint_dir(root, step)
    if not tmp.is_dir():
        raise FileNotFoundError(f"nothing to commit: {tmp} does not exist (call begin_save first)")
    _sync_dirs(tmp)
    old = final.with_name(final.name + ".old")
    replacing = final.exists()
    if replacing:
        if old.exists():
            _discard(old)               # stale: only beside its step_N (see prune_stale)
        os.rename(final, old)
    os.rename(tmp, final)
    fsync_dir(final.parent)
    if replacing:
        _discard(old)
    _prune(root, step, keep_last)
    return final


def _discard(path: Path) -> None:
    """Remove a checkpoint directory (`step_N`, `step_N.old`) that resume could read: renamed out
    of those names first, so that a removal cut short leaves `<name>.deleting`, never part of a
    checkpoint under a name that says it is whole (or that prune_stale would rename back)."""
    doomed = path.with_name(path.name + ".deleting")
    shutil.rmtree(doomed, ignore_errors=True)
    os.rename(path, doomed)
    fsync_dir(path.parent)
    shutil.rmtree(doomed, ignore_errors=True)


def _sync_dirs(path: Path) -> None:
    # The files are fsynced as written, but the names in a directory (manifest.json renamed into
    # place last) are durable only once the directory is: before the rename that publishes them.
    for directory in sorted((p for p in path.rglob("*") if p.is_dir()), reverse=True):
        fsync_dir(directory)
    fsync_dir(path)


def fsync_dir(path: Path):
    # Make the rename itself durable (POSIX), not only the files inside.
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _prune(root, step: int, keep_last: int | None):
    root = Path(root)
    # Interrupted saves of earlier steps will never be completed.
    for path in root.glob("step_*.tmp"):
        match = _TMP_DIR.match(path.name)
        if match and int(match.group(1)) < step:
            shutil.rmtree(path, ignore_errors=True)
    if keep_last is not None and keep_last > 0:
        # Only checkpoints older than the one just committed count against keep_last: a newer one
        # is left from before a resume that fell back past it (it was damaged), and is replaced
        # when the run gets there; counting it would remove the checkpoint just written.
        older = [path for path in list_checkpoints(root) if checkpoint_step(path) < step]
        for path in older[:max(0, len(older) - (keep_last - 1))]:
            _discard(path)


# ---------------------------------------------------------------- the run's directory

CHECKPOINTS = "checkpoints"
RUN_FILES = ("metrics.jsonl", CHECKPOINTS, "actor_hf")


def earlier_run(output_dir) -> list[str]:
    """What an earlier run left in `output_dir` (metrics, checkpoints, an export)."""
    out = Path(output_dir)
    return [name for name in RUN_FILES if (out / name).exists()]


def output_dir_problems(trainer) -> list[str]:
    """What is wrong with `trainer.output_dir` for this run (one line each, for check_config):
    an earlier run there that the flags neither resume nor overwrite. [] for a config without
    an output directory."""
    if not hasattr(trainer, "output_dir"):
        return []
    out, earlier = trainer.output_dir, earlier_run(trainer.output_dir)
    overwrite = getattr(trainer, "overwrite", False)
    if trainer.resume and overwrite:
        return ["--trainer.resume and --trainer.overwrite: choose one (continue the run there, or replace it)"]
    # a run that failed before its first checkpoint is started again by --trainer.resume (it has
    # nothing to lose but its metrics); one that ended with its export is not silently replaced
    if trainer.resume and "actor_hf" in earlier and not list_checkpoints(Path(out) / CHECKPOINTS):
        return [f"--trainer.resume: {out} holds a finished run ({', '.join(earlier)}) but no complete "
                f"checkpoint to continue from (it ran without --trainer.save-every?); start over with "
                f"--trainer.overwrite, or choose another --trainer.output-dir"]
    if earlier and not trainer.resume and not overwrite:
        return [f"--trainer.output-dir {out} holds an earlier run ({', '.join(earlier)}): continue it with "
                f"--trainer.resume, replace it with --trainer.overwrite, or choose another --trainer.output-dir"]
    return []


def prepare_output_dir(trainer, log=print) -> None:
    """After check_config: clear an earlier run on --trainer.overwrite, and say what a
    --trainer.resume will do (the Run object says which step it resumed)."""
    out = Path(trainer.output_dir)
    earlier = earlier_run(out)
    if getattr(trainer, "overwrite", False) and earlier:
        for name in earlier:
            target = out / name
            shutil.rmtree(target) if target.is_dir() else target.unlink()
        log(f"hflow: --trainer.overwrite: removed the earlier run's {', '.join(earlier)} in {out}")
    if trainer.resume and not list_checkpoints(out / CHECKPOINTS):
        log(f"hflow: --trainer.resume: nothing to resume in {out} (no checkpoint yet); starting at step 0")
