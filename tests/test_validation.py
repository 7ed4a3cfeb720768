"""hflow.validation: every numeric flag of every recipe has a rule (or is listed as free), a bad
value of each is named in one line, paths must exist, and a used output directory is refused."""
import dataclasses
import importlib.util
import sys
from pathlib import Path

import pytest
import tyro

from hflow.checkpoint import output_dir_problems, prepare_output_dir
from hflow.validation import RULES, ConfigError, check_config, fields_of, flag, problems

RECIPES = Path(__file__).resolve().parents[1] / "recipes"
# numbers any value of which can work (seeds, weights that may be negative, thresholds)
FREE = {"seed", "default_seed", "task_seed", "cost_threshold", "model_weight", "lambda_init",
        "lambda_lr", "lambda_max", "overlong_penalty", "task_eval_size", "eval_batch_size",
        "val_fraction", "margin", "model_max_tokens_per_micro_batch", "pair_accuracy_every",
        "cost_sign_weight", "judge_weight", "interval", "print_every", "tensorboard", "inline", "target", "head_init_seed"}
CANDIDATES = (0, -1, 1.5, -0.5, 2, float("nan"), (1.5, 0.5))


def recipe_configs():
    for path in sorted(RECIPES.glob("*.py")):
        spec = importlib.util.spec_from_file_location(f"recipe_{path.stem}", path)
        module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        if hasattr(module, "Config"):
            yield path.stem, tyro.cli(module.Config, args=[])


CONFIGS = dict(recipe_configs())


def replaced(cfg, path, value):
    if len(path) == 1:
        return dataclasses.replace(cfg, **{path[0]: value})
    return dataclasses.replace(cfg, **{path[0]: replaced(getattr(cfg, path[0]), path[1:], value)})


def numeric_fields(cfg):
    return [(path, value) for path, value in fields_of(cfg)
            if isinstance(value, (int, float)) and not isinstance(value, bool)]


@pytest.mark.parametrize("recipe", sorted(CONFIGS))
def test_every_recipes_defaults_pass(recipe):
    assert problems(CONFIGS[recipe]) == []


@pytest.mark.parametrize("recipe", sorted(CONFIGS))
def test_every_numeric_flag_has_a_rule_or_is_known_to_be_free(recipe):
    unchecked = [flag(path) for path, _ in numeric_fields(CONFIGS[recipe])
                 if path[-1] not in RULES and path[-1] not in FREE]
    assert unchecked == [], f"add a rule to hflow.validation.RULES (or FREE here) for {unchecked}"


@pytest.mark.parametrize("recipe", sorted(CONFIGS))
def test_a_bad_value_of_every_checked_flag_is_named_in_one_line(recipe):
    cfg = CONFIGS[recipe]
    checked = 0
    for path, value in fields_of(cfg):
        rule = RULES.get(path[-1])
        if rule is None or isinstance(value, bool) or isinstance(value, str):
            continue
        bad = next(c for c in CANDIDATES if _same_kind(c, value) and _rejects(rule, c))
        found = problems(replaced(cfg, path, bad))
        assert len(found) == 1 and found[0].startswith(f"{flag(path)} {bad}: "), (path, bad, found)
        checked += 1
    assert checked >= 4


def _same_kind(candidate, value):
    if isinstance(value, tuple):
        return isinstance(candidate, tuple)
    if isinstance(value, int):
        return isinstance(candidate, int)
    return isinstance(candidate, (int, float))


def _rejects(rule, value):
    try:
        return value != value or rule(value) is not None
    except TypeError:
        return False


@pytest.mark.parametrize("flag_path, value, message", [
    (("rollout", "n"), 0, "--rollout.n 0: must be >= 1 (samples per prompt)"),
    (("actor", "optim", "lr"), -1.0, "--actor.optim.lr -1.0: must be > 0 (a learning rate)"),
    (("rollout", "top_p"), 0.0, "--rollout.top-p 0.0: must be in (0, 1]"),
    (("rollout", "temperature"), -0.1, "--rollout.temperature -0.1: must be >= 0"),
    (("algo", "clip_low"), 1.0, "--algo.clip-low 1.0: must be in (0, 1)"),
    (("algo", "lam"), 1.5, "--algo.lam 1.5: must be in [0, 1]"),
    (("model", "path"), "/no/such/model", "--model.path /no/such/model: no such file or directory"),
    (("data", "train_files"), ["/no/such.jsonl"], "--data.train-files /no/such.jsonl: no such file"),
])
def test_the_issues_examples(flag_path, value, message):
    with pytest.raises(ConfigError) as raised:
        check_config(replaced(CONFIGS["ppo"], flag_path, value))
    assert message in str(raised.value)


@pytest.mark.parametrize("name", ["smollm2-135m-instruct", "gemma3-270m", "HuggingFaceTB/SmolLM2-135M-Instruct"])
def test_a_fetched_model_name_or_a_hub_id_is_a_model_path(name):
    """resolve_model takes these (docs/real-model.md): the path check must not refuse them first."""
    check_config(replaced(CONFIGS["ppo"], ("model", "path"), name))
    with pytest.raises(ConfigError, match="no such file or directory"):
        check_config(replaced(CONFIGS["ppo"], ("data", "train_files"), [name]))


def trainer(out, **kw):
    return dataclasses.replace(CONFIGS["ppo"].trainer, output_dir=str(out), **kw)


def check(cfg):
    """What the launcher checks: the flags, and the output directory."""
    check_config(cfg, output_dir_problems(cfg.trainer))


def test_a_used_output_dir_is_refused_unless_resumed_or_overwritten(tmp_path, capsys):
    out = tmp_path / "out"
    (out / "checkpoints" / "step_4").mkdir(parents=True)
    (out / "metrics.jsonl").write_text("{}\n")
    cfg = dataclasses.replace(CONFIGS["ppo"], trainer=trainer(out))
    with pytest.raises(ConfigError, match="holds an earlier run .*--trainer.resume.*--trainer.overwrite"):
        check(cfg)
    with pytest.raises(ConfigError, match=r"^--rollout.n 0: must be >= 1 .*\n--trainer.output-dir .* holds an earlier run"):
        check(replaced(cfg, ("rollout", "n"), 0))           # one message: the flags, then the directory
    check(dataclasses.replace(cfg, trainer=trainer(out, resume=True)))
    overwrite = trainer(out, overwrite=True)
    check(dataclasses.replace(cfg, trainer=overwrite))
    prepare_output_dir(overwrite)
    assert not (out / "metrics.jsonl").exists() and not (out / "checkpoints").exists()
    assert "removed the earlier run's metrics.jsonl, checkpoints" in capsys.readouterr().out


def test_resume_without_a_checkpoint_starts_over_unless_the_run_had_finished(tmp_path, capsys):
    """A run that crashed at step 1 leaves metrics (step 0) and no checkpoint: --trainer.resume
    starts it again at step 0 (it used to be refused, as was the plain command); a finished
    run (exported) with no checkpoint is not replaced without --trainer.overwrite."""
    crashed = tmp_path / "crashed"
    crashed.mkdir()
    (crashed / "metrics.jsonl").write_text('{"step": 0}\n')
    cfg = dataclasses.replace(CONFIGS["ppo"], trainer=trainer(crashed, resume=True))
    check(cfg)
    prepare_output_dir(cfg.trainer)
    assert "nothing to resume in" in capsys.readouterr().out
    finished = tmp_path / "finished"
    (finished / "actor_hf").mkdir(parents=True)
    (finished / "metrics.jsonl").write_text('{"step": 0}\n')
    with pytest.raises(ConfigError, match="holds a finished run .*no complete checkpoint"):
        check(dataclasses.replace(CONFIGS["ppo"], trainer=trainer(finished, resume=True)))
    fresh = trainer(tmp_path / "fresh", resume=True)
    check(dataclasses.replace(CONFIGS["ppo"], trainer=fresh))
    prepare_output_dir(fresh)
    assert "nothing to resume in" in capsys.readouterr().out


# ---------------------------------------------------------------- under torchrun

from dist import torchrun   # noqa: E402


@pytest.mark.dist
def test_a_bad_flag_is_one_message_from_rank_0_and_torchruns_summary_names_it(tmp_path):
    run = torchrun(str(RECIPES / "example.py"), 2, ["--log-every", "0"], timeout=120)
    assert run.returncode != 0 and not run.timed_out, run.output
    message = "--log-every 0: must be >= 1 (steps between log lines)"
    assert run.output.count(f"error: {message}") == 1, run.output        # rank 0 alone
    assert f"traceback : {message}" in run.output, run.output            # torchrun's summary
    assert "exitcode  : 2" in run.output and run.output.count("exitcode  :") == 1   # only rank 0 failed


@pytest.mark.dist
def test_an_unknown_flag_and_help_print_once(tmp_path):
    typo = torchrun(str(RECIPES / "example.py"), 2, ["--log-evry", "0"], timeout=120)
    assert typo.returncode != 0 and typo.output.count("Unrecognized options: --log-evry") == 1, typo.output
    helped = torchrun(str(RECIPES / "example.py"), 2, ["--help"], timeout=120)
    assert helped.returncode == 0 and helped.output.count("--log-every INT") == 1, helped.output
    assert "starts N ranks" in helped.output   # where ranks come from


def test_train_files_without_val_files_get_a_notice(tmp_path):
    from hflow.validation import notices
    data_file = tmp_path / "train.jsonl"
    data_file.write_text('{"prompt": "1+1=", "answer": "2"}\n')
    cfg = replaced(CONFIGS["grpo"], ("data", "train_files"), [str(data_file)])
    assert any("no held-out evaluation" in line for line in notices(cfg))
    assert notices(CONFIGS["grpo"]) == []


def test_a_broken_or_wrong_shape_config_json_is_a_config_error_naming_the_file(tmp_path):
    """Every reader of a model directory's config.json (and generation_config.json): json's own
    error names no file, and a list or a missing key failed later as a TypeError or KeyError."""
    from types import SimpleNamespace

    from hflow.engine import stop_token_ids
    from hflow.planner.models import model_shape
    from hflow.recipe_kit.set_up import check_policy_dir, context_room
    rollout = SimpleNamespace(max_model_len=0, max_tokens=16)
    readers = {"check_policy_dir": check_policy_dir, "context_room": lambda p: context_room(p, rollout),
               "model_shape": lambda p: model_shape(str(p)), "stop_token_ids": lambda p: stop_token_ids(str(p))}

    def error_of(read, path) -> str:
        with pytest.raises(ConfigError) as e:
            read(path)
        return str(e.value)

    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text('{"model_type": "llama",\n "hidden_size": 64\n "vocab_size": 8}\n')
    wrong_shape = tmp_path / "list"
    wrong_shape.mkdir()
    (wrong_shape / "config.json").write_text('[{"model_type": "llama"}]\n')
    for name, read in readers.items():
        message = error_of(read, broken)
        assert f"{broken / 'config.json'} is not JSON: Expecting ',' delimiter at line 3 column 2" in message, name
        assert f"{wrong_shape / 'config.json'} holds a JSON array, not an object" in error_of(read, wrong_shape), name
    assert error_of(check_policy_dir, broken).startswith(f"--model.path {broken}: ")   # the flag to look at

    # a key a reader needs, missing: the file and the key (and the flag that stands in for it)
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "config.json").write_text('{"model_type": "llama"}\n')
    message = error_of(readers["context_room"], bare)
    assert f"{bare / 'config.json'} has no max_position_embeddings" in message and "--rollout.max-model-len" in message
    assert f"{bare / 'config.json'}: not a decoder config the planner can read (no num_hidden_layers)" in \
        error_of(readers["model_shape"], bare)
    (bare / "generation_config.json").write_text('{"eos_token_id": 2,}')
    assert f"{bare / 'generation_config.json'} is not JSON" in error_of(readers["stop_token_ids"], bare)
    (bare / "config.json").write_text('{"model_type": "llama", "max_position_embeddings": true}\n')
    assert "has max_position_embeddings True, not a positive integer" in error_of(readers["context_room"], bare)
    (bare / "config.json").write_text('{"model_type": "llama", "max_position_embeddings": 64, "eos_token_id": 2}\n')
    (bare / "generation_config.json").unlink()
    check_policy_dir(bare)
    assert context_room(bare, rollout).tokens == 64 - 16 and stop_token_ids(str(bare)) == [2]
    # no config.json at all, or a model the engine does not run: one line each, no traceback
    assert "not a Hugging Face model directory (no config.json)" in error_of(check_policy_dir, tmp_path)
    (bare / "config.json").write_text('{"model_type": "mamba"}')
    assert "model_type 'mamba' is not supported" in error_of(check_policy_dir, bare)
