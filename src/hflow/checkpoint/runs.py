"""Checkpoints of a whole run, driven by the single controller: every trained worker group's
sharded state plus the controller's own, and resuming from the newest one that verifies."""
from __future__ import annotations

import shutil
import sys
from pathlib import Path

from hflow.faults import fault_point

from .dirs import begin_save, checkpoint_step, commit, latest_checkpoint, list_checkpoints, prune_stale
from .errors import CheckpointError, disk_full_error, is_disk_full
from .extra import EXTRA_FILE, read_extra, write_extra
from .integrity import check_dcp_extents, verify, warn_unverified, write_manifest
from .safe_format import read_dcp_metadata
from .state import rng_state, set_rng_state

_RUN_HINT = ("Free some space or write checkpoints to a larger disk (or keep fewer: --trainer.keep-last), then "
             "continue from the last complete one with --trainer.resume.")


def _add_reported(reported: dict, role: str, result) -> None:
    # a group's save returns one {file: entry} per rank ("all" dispatch); anything else
    # (a worker that reports nothing) leaves its files to write_manifest to hash
    for part in result if isinstance(result, list) else [result]:
        if isinstance(part, dict):
            reported.update({f"{role}/{name}": entry for name, entry in part.items()
                             if isinstance(entry, dict) and {"size", "sha256"} <= set(entry)})


def save_run(root, step: int, groups: dict, extra: dict, keep_last: int | None = None) -> Path:
    """Checkpoint every trainable worker group (sharded, in parallel) and the controller's own
    state, committed as `<root>/step_<step>` only when all of it is written and listed in the
    manifest. On failure `step_<step>.tmp` is removed; a full disk raises one CheckpointError
    saying so."""
    tmp = begin_save(root, step)
    try:
        futures = [(role, group.save.future(str(tmp / role))) for role, group in groups.items()]
        reported, failure = {}, None
        for role, future in futures:           # wait for all: none is still writing into tmp
            try:
                _add_reported(reported, role, future.result())
            except BaseException as e:
                failure = failure or e
        if failure is not None:
            raise failure
        reported[EXTRA_FILE] = write_extra(tmp, {**extra, "rng": rng_state()})
        write_manifest(tmp, step, reported)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if is_disk_full(e):
            raise disk_full_error(tmp, latest_checkpoint(root), removed=True, hint=_RUN_HINT) from e
        raise
    fault_point("checkpoint")
    return commit(root, step, keep_last)


def _problems(path: Path, roles) -> list[str] | None:
    """What is wrong with a checkpoint, [] when nothing; None when nothing is found but it has no
    manifest to check its bytes against. Every group's `.metadata` is also read here (through the
    allowlist) and its shards' lengths checked: a crafted or damaged one then counts against the
    checkpoint on the controller, instead of failing a worker's load."""
    verified = verify(path)
    if verified:
        return verified
    problems = []
    for role in roles:
        if not (path / role / ".metadata").is_file():
            problems.append(f"{role}/.metadata is missing")
            continue
        try:
            problems += check_dcp_extents(path / role, read_dcp_metadata(path / role))
        except CheckpointError as e:
            problems.append(str(e))
    return problems if problems or verified is not None else None


def _newest_sound(root, roles) -> tuple[Path, bool] | None:
    """The newest checkpoint that verifies (and whether it had a manifest), saying in one line
    which newer ones were damaged; CheckpointError when none is sound."""
    damaged = []
    for path in reversed(list_checkpoints(root)):
        problems = _problems(path, roles)
        if not problems:
            if damaged:
                print("hflow: " + "; ".join(f"checkpoint {p.name} (step {checkpoint_step(p)}) is damaged: "
                                            f"{', '.join(lines)}" for p, lines in damaged)
                      + f"; resuming from {path.name} (step {checkpoint_step(path)}) instead", file=sys.stderr, flush=True)
            return path, problems is not None
        damaged.append((path, problems))
    if not damaged:
        return None
    raise CheckpointError("\n".join(
        [f"no checkpoint under {root} can be resumed from: every one is damaged"]
        + [f"  {p.name}: {'; '.join(lines)}" for p, lines in damaged]
        + ["Restore them from a copy, or move them away to start the run over."]))


CHANGED = "changed_settings"


def resume_run(root, groups: dict) -> dict | None:
    """Load the newest complete checkpoint under `root` whose files verify into the groups;
    returns the controller state saved with it plus its "step" and, under CHANGED, the settings
    this run's flags changed in each group (role -> {name: (checkpoint's, this run's)}), or None
    when there is no checkpoint.
    Partial saves (`step_N.tmp`) are removed first."""
    prune_stale(root)
    found = _newest_sound(root, list(groups))
    if found is None:
        return None
    path, verified = found
    if not verified:
        warn_unverified(path)
    changed = {}
    for role, future in [(role, group.load.future(str(path / role))) for role, group in groups.items()]:
        result = future.result()
        # every rank of a group applies the same flags: its first rank's answer is the group's
        first = result[0] if isinstance(result, list) and result else result
        if isinstance(first, dict) and first:
            changed[role] = first
    extra = read_extra(path)
    if "rng" in extra:
        set_rng_state(extra.pop("rng"))
    return {**extra, "step": checkpoint_step(path), CHANGED: changed}
