"""Checkpoints: sharded save/resume with torch.distributed.checkpoint, and Hugging Face export.

Layout of a checkpoint root (`--trainer.output-dir`/checkpoints):

    step_4/               complete: renamed from step_4.tmp only after every rank finished
      <name>/.metadata, __0_0.distcp, ...   one DCP checkpoint per sharded state (e.g. actor, critic)
      extra.json          the controller's state (data position, KL controller, RNG, ...)
      manifest.json       size and sha256 of every file above, written last
    step_6.tmp/           a save in progress, or one that failed or was interrupted: never read,
                          removed when the next save begins and on resume
    step_4.old/           step_4 moved aside while step 4 is saved again; renamed back if the
                          save dies before step_4.tmp takes its name
    step_2.deleting/      a checkpoint being removed (keep_last), renamed first so that a removal
                          cut short never leaves part of one under its name

The rename is the commit: a crash at any point leaves every earlier `step_N` intact, and
`latest_checkpoint` ignores `.tmp` directories (tests/test_checkpoint_crash_sweep.py kills a save
at each of its disk operations). A save that fails (a full disk says so, with the free space)
removes its `.tmp`. Resuming checks the newest checkpoint's files against its manifest and falls
back to the newest one that verifies, saying which was damaged (an unreadable manifest too).
`keep_last` counts the checkpoint just committed and those before it: a newer one left from
before a fallback stays until the run replaces it. A Hugging Face export is written beside its
directory and renamed into place whole.

Loading runs no code from the checkpoint: `extra.json` and the RNG states are JSON, and DCP's
pickles are read through allowlists (safe_format). Checkpoints without a manifest still load,
unverified, with a warning.

The single controller drives it (hflow's recipes): `save_run` / `resume_run`. The controller
calls `begin_save`, asks each worker group to `save_sharded(tmp / role, state, group)` (which
returns the hashes of what each rank wrote), waits for all of them, writes `write_extra` and the
manifest, then `commit`. Resume: each group `load_sharded(path / role, ...)`, `read_extra`.

Sharded state is a dict of `Stateful` objects (`ModelState`, `RNGState`) and/or tensors; DCP
saves each rank's shards in parallel and reshards on load. Optimizer state is initialised by
`get_state_dict` before loading, so a freshly built optimizer can be resumed into.

Before a run starts, `output_dir_problems` / `prepare_output_dir` check and prepare the run's
output directory (`<output_dir>/checkpoints` is the root).

Modules: dirs (the directories and the commit, the output directory), sharded (DCP save/load),
integrity (the manifest), safe_format (JSON and allowlisted pickles), extra, state, runs, export,
errors.
"""
from .dirs import (begin_save, checkpoint_dir, checkpoint_step, commit, latest_checkpoint, list_checkpoints,
                   output_dir_problems, prepare_output_dir, prune_stale, temporary_dir)
from .errors import CheckpointError
from .export import export_hf, export_peft_adapter
from .extra import EXTRA_FILE, read_extra, write_extra
from .integrity import MANIFEST, verify
from .runs import resume_run, save_run
from .sharded import load_sharded, save_sharded
from .state import ModelState, RNGState, rng_state, set_rng_state

__all__ = ["save_run", "resume_run", "latest_checkpoint", "list_checkpoints", "checkpoint_dir", "checkpoint_step",
           "begin_save", "commit", "save_sharded", "load_sharded", "write_extra", "read_extra", "export_hf",
           "export_peft_adapter", "ModelState", "RNGState", "rng_state", "set_rng_state", "temporary_dir", "prune_stale",
           "output_dir_problems", "prepare_output_dir", "verify", "CheckpointError", "EXTRA_FILE", "MANIFEST"]
