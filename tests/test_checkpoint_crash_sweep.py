"""Crash consistency of the checkpoint protocol, at every point: the saving process (a forked
child) is killed at each of its disk operations in turn (every write, fsync, mkdir, rename,
replace, unlink and rmdir of save_run: begin_save's clearing, the shards, extra.json, the manifest,
the commit, keep_last's pruning), until it finishes without reaching the next one. After each
crash: every `step_N` left verifies, resume finds the newest sound checkpoint (the new one exactly
when the commit's rename was done) with its weights, and the next save and resume work; resume is
also killed at each of its own disk operations (its clearing of what the save left), once for
each different set of names a crash left. Then sequences of save, damage, resume and changing
keep_last against a model of what must be on disk; and the Hugging Face export killed at each
operation: `actor_hf` is the old one or the new one, whole, or absent.

The state saved is one 2x2 weight through the trainer's own entry points (save_run/resume_run, a
group whose save is save_sharded): the protocol does not depend on the model, and the number of
crash points grows with the tensors (each is ~40 writes). `pytest -s` prints the counts
(docs/reliability.md quotes them)."""
import random
import shutil
from collections import Counter
from pathlib import Path

import pytest
import torch

from hflow import checkpoint as ck
from hflow.checkpoint.dirs import output_dir_problems
from programs.checkpoint_crash_points import crash_points, scratch_dir
from programs.checkpoint_fake_group import FakeGroup

@pytest.fixture(autouse=True)
def _keep_rng():
    # resume_run sets the process's random streams to the checkpoint's
    saved = ck.rng_state()
    yield
    ck.set_rng_state(saved)


def _group(version: int) -> dict:
    model = torch.nn.Linear(2, 2, bias=False)
    with torch.no_grad():
        model.weight.fill_(version)
    return {"actor": FakeGroup(model)}


def _save(root, step, version, keep_last=None):
    ck.save_run(root, step, _group(version), {"version": version}, keep_last)


def _resume(root):
    """(step, version) resume finds, None when there is nothing; its weights checked."""
    groups = _group(-1)
    extra = ck.resume_run(root, groups)
    if extra is None:
        return None
    assert torch.equal(groups["actor"].model.weight, torch.full((2, 2), float(extra["version"])))
    return extra["step"], extra["version"]


def _names(root):
    return sorted(p.name for p in root.iterdir())


def _all_verify(root):
    damaged = {p.name: ck.verify(p) for p in ck.list_checkpoints(root) if ck.verify(p) != []}
    assert not damaged, f"a checkpoint name holds a damaged or partial checkpoint: {damaged}"


# ---------------------------------------------------------------- killed at every disk operation

def _stale_tmp(root):
    # an earlier save that died: begin_save must clear it
    (root / "step_5.tmp" / "actor").mkdir(parents=True)
    (root / "step_5.tmp" / "actor" / "__0_0.distcp").write_bytes(b"partial")


SCENARIOS = {
    # name: (what is there, the save that is killed, (step, version) of the save, before it)
    "the first save": (lambda root: None, lambda root: _save(root, 1, 1, keep_last=2), (1, 1), None),
    "a new step: a stale .tmp cleared, keep_last prunes": (
        lambda root: (_save(root, 1, 1), _save(root, 2, 2), _stale_tmp(root)),
        lambda root: _save(root, 3, 3, keep_last=2), (3, 3), (2, 2)),
    "a step saved again (after a fallback), keep_last 1": (
        lambda root: (_save(root, 1, 1), _save(root, 2, 2)),
        lambda root: _save(root, 2, 22, keep_last=1), (2, 22), (2, 2)),
}


def _after_crash(root, expected):
    """What must hold of what a crash left (and again after a crash in resume's clearing)."""
    assert _resume(root) == expected, _names(root)
    _all_verify(root)


def _recovery_crash_points(root, expected) -> int:
    """Kill resume_run at each of its own disk operations (its clearing of what the save left);
    each time, the next resume must still find `expected`."""
    return crash_points(lambda copy: shutil.copytree(root, copy, dirs_exist_ok=True),
                        lambda copy: ck.resume_run(copy, _group(-1)),
                        lambda copy, ops: _after_crash(copy, expected))


def _names_left(root) -> tuple:
    # what resume's clearing acts on: names, not bytes (states that differ only in how much of a
    # file in step_N.tmp was written are cleared alike)
    return tuple(sorted((p.relative_to(root).as_posix(), p.is_dir()) for p in root.rglob("*")))


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_a_save_killed_at_any_disk_operation_leaves_the_newest_sound_checkpoint(scenario):
    prepare, save, new, previous = SCENARIOS[scenario]
    committed_at, recovered = [], {}

    def check(root, ops):
        committed = any(op[0] == "rename" and op[1].endswith(".tmp") and op[2] == f"step_{new[0]}"
                        for op in ops[:-1])
        expected = new if committed else previous
        if committed and not committed_at:
            committed_at.append(len(ops) - 1)
        left = _names_left(root)
        if left not in recovered:
            recovered[left] = _recovery_crash_points(root, expected)
        _after_crash(root, expected)
        next_step = (expected or (0, 0))[0] + 1
        _save(root, next_step, 100, keep_last=2)
        assert _resume(root) == (next_step, 100)
        assert all(name.startswith("step_") and name[5:].isdigit() for name in _names(root)), _names(root)
        _all_verify(root)

    points = crash_points(prepare, save, check)
    assert committed_at, "no crash point after the commit's rename"
    print(f"\n{scenario}: {points} crash points (the commit's rename is operation {committed_at[0]}); "
          f"{len(recovered)} distinct states left, {sum(recovered.values())} crash points in the resumes after them")


# ---------------------------------------------------------------- save, damage, resume, keep_last

def _damage(path, kind):
    shard = path / "actor" / "__0_0.distcp"
    if kind == "zeroed manifest":
        (path / ck.MANIFEST).write_bytes(b"\0" * (path / ck.MANIFEST).stat().st_size)
    elif kind == "manifest of another shape":
        (path / ck.MANIFEST).write_text('{"files": []}')
    elif kind == "truncated shard":
        shard.write_bytes(shard.read_bytes()[:100])
    elif kind == "changed shard bytes":
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] = (data[len(data) // 2] + 1) % 256     # damaged twice is still damaged
        shard.write_bytes(bytes(data))
    elif kind == "extra.json deleted":
        (path / "extra.json").unlink(missing_ok=True)
    else:
        raise ValueError(kind)


DAMAGE = ["zeroed manifest", "manifest of another shape", "truncated shard", "changed shard bytes",
          "extra.json deleted"]
KEEP_LAST = [1, 2, 3, None]


class _Model:
    """What must be on disk: step -> (version, sound), and the step the run is at."""

    def __init__(self):
        self.checkpoints, self.position, self.versions = {}, 0, 0

    def save(self, keep_last):
        self.versions += 1
        self.position += 1
        self.checkpoints[self.position] = (self.versions, True)
        older = sorted(s for s in self.checkpoints if s < self.position)
        if keep_last:
            for step in older[:max(0, len(older) - (keep_last - 1))]:
                del self.checkpoints[step]
        return self.position, self.versions

    def damage(self, step):
        self.checkpoints[step] = (self.checkpoints[step][0], False)

    def newest_sound(self):
        sound = [s for s, (_, ok) in self.checkpoints.items() if ok]
        return (max(sound), self.checkpoints[max(sound)][0]) if sound else None


def _run_sequence(root, rng, length, tally: Counter) -> list[str]:
    model, done, keep_last_before = _Model(), [], "none yet"
    for _ in range(length):
        op = rng.choice(["save", "save", "damage", "resume"])
        if op == "damage" and model.checkpoints:
            # mostly the newest, which a resume then has to fall back past
            newest = rng.random() < 0.7
            step = max(model.checkpoints) if newest else rng.choice(sorted(model.checkpoints))
            kind = rng.choice(DAMAGE)
            _damage(ck.checkpoint_dir(root, step), kind)
            model.damage(step)
            done.append(f"damage step {step}: {kind}")
        elif op == "resume":
            expected = model.newest_sound()
            if expected is None and model.checkpoints:
                with pytest.raises(ck.CheckpointError, match="every one is damaged"):
                    _resume(root)
                model.position = 0           # the run starts over, in the same directory
                tally["resume: none sound (refused)"] += 1
            else:
                assert _resume(root) == expected, done
                model.position = expected[0] if expected else 0
                if expected and max(model.checkpoints) > expected[0]:
                    tally["resume falling back past damaged ones"] += 1
            done.append(f"resume: {expected}")
        else:
            keep_last = rng.choice(KEEP_LAST)
            if model.position + 1 in model.checkpoints:
                tally["save replacing a step"] += 1
            if model.checkpoints and max(model.checkpoints) > model.position + 1:
                tally["save below a newer checkpoint"] += 1
            if keep_last_before not in ("none yet", keep_last):
                tally["save with keep_last changed"] += 1
            step, version = model.save(keep_last)
            _save(root, step, version, keep_last)
            keep_last_before = keep_last
            done.append(f"save step {step} keep_last {keep_last}")
        tally[done[-1].split(" ")[0].rstrip(":")] += 1
        on_disk = {ck.checkpoint_step(p): ck.verify(p) == [] for p in ck.list_checkpoints(root)}
        assert on_disk == {s: ok for s, (_, ok) in model.checkpoints.items()}, done
        assert [p for p in root.iterdir() if not p.name.startswith("step_") or "." in p.name] == [], done
    return done


SEQUENCES, LENGTH = 100, 10


def test_sequences_of_save_damage_resume_and_changing_keep_last():
    """Random sequences (fixed seed): after each operation the checkpoints on disk are those the
    model says (keep_last counts the committed one and those before it; a damaged one stays until
    replaced or pruned), and resume finds the newest sound one, or says none is."""
    rng, tally = random.Random(44), Counter()
    with scratch_dir() as scratch:
        for n in range(SEQUENCES):
            root = Path(scratch) / f"run_{n}"
            root.mkdir()
            _run_sequence(root, rng, LENGTH, tally)
    print(f"\n{SEQUENCES} sequences of {LENGTH}: " + ", ".join(f"{k} {v}" for k, v in sorted(tally.items())))
    assert all(tally[k] for k in ("resume falling back past damaged ones", "resume: none sound (refused)",
                                  "save replacing a step", "save below a newer checkpoint", "save with keep_last changed"))


# ---------------------------------------------------------------- the Hugging Face export

def _tiny_model(seed):
    from transformers import Qwen2ForCausalLM
    from hflow.default.model import build_config
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(build_config("tiny", vocab_size=64))


class _Trainer:
    def __init__(self, output_dir):
        self.output_dir, self.resume, self.overwrite = output_dir, True, False


def _tree(path):
    return {p.relative_to(path).as_posix(): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("earlier", [False, True], ids=["first export", "replacing an export"])
def test_an_export_killed_at_any_disk_operation_leaves_the_old_or_the_new_directory_whole(tmp_path, earlier):
    old_model, new_model = _tiny_model(0), _tiny_model(1)
    ck.export_hf(old_model, tmp_path / "old")
    ck.export_hf(new_model, tmp_path / "new")
    old, new = _tree(tmp_path / "old"), _tree(tmp_path / "new")

    def prepare(out):
        if earlier:
            shutil.copytree(tmp_path / "old", out / "actor_hf")

    def check(out, ops):
        got = _tree(out / "actor_hf") if (out / "actor_hf").exists() else None
        assert got in ([old, new, None] if earlier else [new, None]), ops[-1]
        if got is None:
            assert output_dir_problems(_Trainer(out)) == []
        if got is None and earlier:
            # between the two renames of a replacement: the earlier export moved aside and the
            # new one beside it, both whole (the run did not finish; its next export clears them)
            assert _tree(out / "actor_hf.replaced") == old and _tree(out / "actor_hf.partial") == new, ops[-1]
        ck.export_hf(new_model, out / "actor_hf")
        assert _tree(out / "actor_hf") == new and _names(out) == ["actor_hf"]

    points = crash_points(prepare, lambda out: ck.export_hf(new_model, out / "actor_hf"), check)
    print(f"\nexport ({'replacing an export' if earlier else 'first'}): {points} crash points")
