"""The recipes end to end on CPU ranks: placements, resume, export, and bad input."""
import json
from pathlib import Path

import pytest
import torch

from dist import PROGRAMS, torchrun
from hflow.default.model import build_default

RECIPES = Path(__file__).resolve().parents[1] / "recipes"
# keys that depend on wall-clock time or the process, not on the computation
TIMING = ("time/", "throughput/", "memory/")


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return build_default(tmp_path_factory.mktemp("tiny") / "model", "tiny", seed=0)


def small_run(model, out, steps=2, *extra):
    return ["--model.path", model, "--trainer.output-dir", out, "--trainer.steps", steps,
            "--data.batch-size", 4, "--rollout.n", 2, "--rollout.max-tokens", 4,
            "--trainer.eval-size", 8, "--trainer.logging.no-progress-bars", *extra]


def rows(out) -> list[dict]:
    return [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]


def without_timing(row: dict) -> dict:
    return {k: v for k, v in row.items() if not k.startswith(TIMING)}


def assert_resumed_equals_straight(straight: list[dict], resumed: list[dict], interrupted_at: int) -> None:
    """A run stopped at `interrupted_at` and resumed logs what the uninterrupted run logged, to the
    last bit (timings aside; the stopped run also evaluated at its last step)."""
    assert [r["step"] for r in resumed] == [r["step"] for r in straight]
    for x, y in zip(straight, resumed):
        x, y = without_timing(x), without_timing(y)
        if x["step"] == interrupted_at:
            y = {k: v for k, v in y.items() if not k.startswith("eval/")}
        assert x == y, x["step"]


@pytest.mark.dist
def test_ppo_split_placement_on_4_ranks_logs_every_metric_and_exports(tiny_model, tmp_path):
    out = tmp_path / "ppo"
    run = torchrun(str(RECIPES / "ppo.py"), 4, small_run(tiny_model, out, 2, "--trainer.placement", "split",
                                                         "--algo.critic-warmup", 0),
                   timeout=400).check()
    assert "returned a view tensor" not in run.output   # FSDP2's warning of the critic's output (issue 27.5)
    logged = rows(out)
    assert [r["step"] for r in logged] == [0, 1, 2]
    assert "eval/reward_mean" in logged[0] and "eval/reward_mean" in logged[-1]
    for key in ("reward/mean", "response_length/mean", "kl/mean", "actor/loss", "actor/clipfrac",
                "actor/grad_norm", "critic/loss", "critic/vf_explained_var", "time/generate_s", "time/update_s", "time/step_s",
                "throughput/tokens_per_s"):
        assert key in logged[1], key

    from transformers import AutoModelForCausalLM, AutoTokenizer
    exported = AutoModelForCausalLM.from_pretrained(out / "actor_hf")
    AutoTokenizer.from_pretrained(out / "actor_hf")
    original = AutoModelForCausalLM.from_pretrained(tiny_model)
    changed = [n for n, p in exported.named_parameters()
               if not torch.equal(p, original.state_dict()[n])]
    assert changed, "the exported actor should carry the trained weights"


@pytest.mark.dist
def test_ppo_resumed_run_matches_the_uninterrupted_one(tiny_model, tmp_path):
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    common = ("--trainer.no-export", "--algo.critic-warmup", 1)   # step 1 trains the critic only
    torchrun(str(RECIPES / "ppo.py"), 2, small_run(tiny_model, straight, 4, *common), timeout=400).check()
    torchrun(str(RECIPES / "ppo.py"), 2, small_run(tiny_model, resumed, 2, "--trainer.save-every", 2, *common),
             timeout=400).check()
    assert (resumed / "checkpoints" / "step_2").is_dir()
    torchrun(str(RECIPES / "ppo.py"), 2, small_run(tiny_model, resumed, 4, "--trainer.resume", *common),
             timeout=400).check()
    assert_resumed_equals_straight(rows(straight), rows(resumed), interrupted_at=2)
    # a flag changed for the resumed run takes effect, and the run says so (issue 23.3)
    again = torchrun(str(RECIPES / "ppo.py"), 2, small_run(tiny_model, resumed, 3, "--trainer.resume",
                                                           "--actor.optim.lr", 3e-6, *common), timeout=400).check()
    assert "resumed from step 2" in again.output
    assert "this run's flags replace the checkpoint's; actor's lr 1e-06 -> 3e-06" in again.output, again.output


@pytest.mark.dist
def test_grpo_colocated_with_reference_runs(tiny_model, tmp_path):
    out = tmp_path / "grpo"
    torchrun(str(RECIPES / "grpo.py"), 2, small_run(tiny_model, out, 2, "--algo.kl-coef", 0.01,
                                                    "--trainer.no-export"), timeout=400,
             env={"HFLOW_COUNT_COMM": "1"}).check()
    logged = rows(out)
    assert [r["step"] for r in logged] == [0, 1, 2]
    assert logged[2]["actor/kl_loss"] >= 0 and "kl/mean" in logged[2]
    assert logged[2]["comm/actor_received_MiB"] > 0   # what rank 0's collectives received this step
    # the flags as they resolved, beside the metrics: a given model's defaults, the flag set here
    config = json.loads((out / "config.json").read_text())
    assert (config["actor"]["optim"]["lr"], config["rollout"]["temperature"], config["algo"]["kl_coef"]) == (1e-5, 0.7, 0.01)


@pytest.mark.dist
def test_grpo_off_policy_old_log_probs_from_the_rollout_equal_recomputed(tiny_model, tmp_path):
    """Two epochs per batch: the engine's sampled-token log-probs as the old ones give the
    update that a separate forward pass gives (fp32), without that pass."""
    logged = {}
    for source in ("recompute", "rollout"):
        out = tmp_path / source
        torchrun(str(RECIPES / "grpo.py"), 2, small_run(tiny_model, out, 2, "--actor.epochs", 2, "--trainer.no-export",
                                                        "--algo.old-log-probs", source), timeout=400).check()
        logged[source] = [without_timing(r) for r in rows(out)]
    assert logged["rollout"][1]["actor/clipfrac"] == logged["recompute"][1]["actor/clipfrac"]
    # no reference model (--algo.kl-coef 0): no KL is computed, so none is logged
    assert not any("kl/mean" in row for run in logged.values() for row in run)
    for a, b in zip(logged["recompute"], logged["rollout"]):
        # only the recomputation has the trainer's log-probs to set beside the engine's
        gap = {k: a.pop(k) for k in list(a) if k.startswith("actor/mismatch/")}
        assert a == pytest.approx(b, rel=1e-4, abs=1e-6), a["step"]
        assert not gap or gap["actor/mismatch/abs_log_ratio_max"] < 1e-5


@pytest.mark.dist
def test_grpo_measures_the_engine_trainer_gap_and_corrects_it_in_bf16(tiny_model, tmp_path):
    """The mismatch metrics every step: ~1e-7 in fp32 (measured here against a recomputation,
    --algo.rollout-correction mis over two epochs), clearly more in bf16, where tis is on by default."""
    gaps = {}
    for name, flags in (("fp32", ("--algo.rollout-correction", "mis", "--actor.epochs", 2)),
                        ("bf16", ("--actor.fsdp.param-dtype", "bfloat16"))):
        out = tmp_path / name
        torchrun(str(RECIPES / "grpo.py"), 2, small_run(tiny_model, out, 2, "--trainer.no-export", *flags),
                 timeout=400).check()
        gaps[name] = rows(out)[1:]
    for row in gaps["fp32"] + gaps["bf16"]:
        assert 0 <= row["actor/mismatch/abs_log_ratio_mean"] <= row["actor/mismatch/abs_log_ratio_max"]
        assert row["actor/mismatch/is_weight_mean"] > 0 and 0 <= row["actor/mismatch/capped_fraction"] <= 1
    assert all(row["actor/mismatch/abs_log_ratio_max"] < 1e-5 for row in gaps["fp32"])
    assert all(row["actor/mismatch/abs_log_ratio_max"] > 1e-4 for row in gaps["bf16"])


@pytest.mark.dist
def test_grpo_with_lora_resumes_exactly_from_adapter_checkpoints_and_exports_both_ways(tiny_model, tmp_path):
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    lora = ("--actor.lora.rank", 4, "--actor.lora.alpha", 8, "--actor.optim.lr", 1e-2)
    torchrun(str(RECIPES / "grpo.py"), 2, small_run(tiny_model, straight, 4, *lora), timeout=400).check()
    torchrun(str(RECIPES / "grpo.py"), 2, small_run(tiny_model, resumed, 2, "--trainer.save-every", 2,
                                                    "--trainer.no-export", *lora), timeout=400).check()
    torchrun(str(RECIPES / "grpo.py"), 2, small_run(tiny_model, resumed, 4, "--trainer.resume",
                                                    "--trainer.save-every", 2, *lora), timeout=400).check()
    assert_resumed_equals_straight(rows(straight), rows(resumed), interrupted_at=2)
    # the checkpoint is the adapters' and their Adam moments: less than the model itself (a full
    # fine-tuning checkpoint holds the weights and two moments, 3x the model)
    model_bytes = sum(f.stat().st_size for f in Path(tiny_model).glob("*.safetensors"))
    ckpt_bytes = sum(f.stat().st_size for f in (resumed / "checkpoints" / "step_2").rglob("*.distcp"))
    assert ckpt_bytes < model_bytes, (ckpt_bytes, model_bytes)
    assert (straight / "actor_hf" / "config.json").exists()
    assert (straight / "actor_hf_lora" / "adapter_config.json").exists()
    # any step's checkpoint converts to the same model as the export (the last step here)
    from hflow.checkpoint.to_hf import main as to_hf
    with pytest.raises(SystemExit, match="holds LoRA adapters .rank 4.: give --lora-alpha"):
        to_hf([str(resumed / "checkpoints" / "step_4"), "--model", str(tiny_model), "--out", str(tmp_path / "x")])
    to_hf([str(resumed / "checkpoints" / "step_4"), "--model", str(tiny_model), "--out", str(tmp_path / "step4"),
           "--lora-alpha", "8"])
    assert_same_weights(tmp_path / "step4", resumed / "actor_hf")
    assert (tmp_path / "step4_lora" / "adapter_model.safetensors").exists()


def assert_same_weights(a, b):
    from safetensors.torch import load_file
    x, y = (load_file(Path(d) / "model.safetensors") for d in (a, b))
    assert set(x) == set(y)
    for name in x:
        torch.testing.assert_close(x[name], y[name], rtol=0, atol=1e-6, msg=name)


@pytest.mark.dist
def test_a_checkpoint_converts_to_the_model_the_run_exports(tiny_model, tmp_path):
    out = tmp_path / "grpo"
    torchrun(str(RECIPES / "grpo.py"), 2, small_run(tiny_model, out, 2, "--trainer.save-every", 2),
             timeout=400).check()
    from hflow.checkpoint.to_hf import main as to_hf
    to_hf([str(out / "checkpoints" / "step_2"), "--model", str(tiny_model), "--out", str(tmp_path / "step2")])
    assert_same_weights(tmp_path / "step2", out / "actor_hf")
    with pytest.raises(SystemExit, match="no 'reward' checkpoint in it .roles: actor."):
        to_hf([str(out / "checkpoints" / "step_2"), "--model", str(tiny_model), "--out", str(tmp_path / "x"),
               "--role", "reward"])
    damaged = out / "checkpoints" / "step_2" / "actor" / "__0_0.distcp"
    damaged.write_bytes(damaged.read_bytes()[:-8] + b"\0" * 8)
    with pytest.raises(SystemExit, match="does not match its manifest: actor/__0_0.distcp has changed bytes"):
        to_hf([str(out / "checkpoints" / "step_2"), "--model", str(tiny_model), "--out", str(tmp_path / "x")])


@pytest.mark.dist
def test_grpo_dapo_dynamic_sampling_fills_the_batch_with_groups_that_differ(tiny_model, tmp_path):
    """DAPO's flags together: groups whose samples all scored alike are dropped and more prompts
    sampled (at most 3 rounds), the rest trained on with clip-higher and overlong shaping."""
    out = tmp_path / "dapo"
    torchrun(str(RECIPES / "grpo.py"), 2, small_run(tiny_model, out, 2, "--trainer.no-export",
                                                    "--reward.fn", "dapo_rewards:length_parity",
                                                    "--algo.dynamic-sampling", "--algo.max-sampling-rounds", 3,
                                                    "--algo.overlong-buffer", 2, "--algo.clip-high", 0.28),
             timeout=400, env={"PYTHONPATH": PROGRAMS}).check()
    for row in rows(out)[1:]:
        assert 0 <= row["dapo/extra_rounds"] <= 2
        assert row["dapo/kept_groups"] == 4 or row["dapo/short_batch"] == 1.0 and row["dapo/extra_rounds"] == 2
        assert row["dapo/kept_groups"] > 0 and "actor/loss" in row


@pytest.mark.dist
def test_grpo_dynamic_sampling_that_keeps_nothing_skips_the_update(tiny_model, tmp_path):
    out = tmp_path / "dapo"
    torchrun(str(RECIPES / "grpo.py"), 2, small_run(tiny_model, out, 1, "--trainer.no-export",
                                                    "--reward.fn", "dapo_rewards:constant",
                                                    "--algo.dynamic-sampling", "--algo.max-sampling-rounds", 2),
             timeout=400, env={"PYTHONPATH": PROGRAMS}).check()
    row = rows(out)[1]
    assert (row["dapo/extra_rounds"], row["dapo/kept_groups"], row["dapo/short_batch"]) == (1.0, 0.0, 1.0)
    assert "actor/loss" not in row and row["reward/mean"] == 1.0


@pytest.mark.dist
def test_a_reward_function_that_always_fails_stops_the_run_with_one_message(tiny_model, tmp_path):
    out = tmp_path / "broken"
    run = torchrun(str(RECIPES / "grpo.py"), 2, small_run(tiny_model, out, 10, "--trainer.no-export",
                                                          "--reward.fn", "dapo_rewards:nothing"),
                   timeout=400, env={"PYTHONPATH": PROGRAMS})
    assert run.returncode == 1 and not run.timed_out, run.output
    assert run.output.count("error: the reward function failed on every response of 3 batches in a row") == 1, \
        run.output
    assert [r["step"] for r in rows(out)] == [0, 1, 2]   # steps 1 and 2 logged, step 3 stopped the run


@pytest.mark.dist
def test_grpo_reinforce_pp_with_kl_in_the_reward_and_the_gspo_loss_runs(tiny_model, tmp_path):
    out = tmp_path / "rpp"
    torchrun(str(RECIPES / "grpo.py"), 2, small_run(tiny_model, out, 2, "--trainer.no-export",
                                                    "--algo.estimator", "reinforce_pp", "--algo.kl-coef", 0.01,
                                                    "--algo.loss", "gspo"), timeout=400).check()
    row = rows(out)[2]
    assert "kl/mean" in row and "actor/kl_loss" not in row   # REINFORCE++ puts the KL in the reward
    assert 0 <= row["actor/clipfrac"] <= 1


@pytest.mark.parametrize("recipe, embedded_tokens, given_tokens", [("grpo", 5, 512), ("agent", 48, 1024)])
def test_grpo_defaults_depend_on_the_model(recipe, embedded_tokens, given_tokens):
    """The embedded default's toy values apply only to it; a --model.path gets the usual ones;
    a flag the user sets wins either way."""
    import importlib.util
    import sys
    import tyro
    from hflow.model_defaults import resolve_defaults

    spec = importlib.util.spec_from_file_location(f"{recipe}_recipe", RECIPES / f"{recipe}.py")
    module = sys.modules[f"{recipe}_recipe"] = importlib.util.module_from_spec(spec)   # dataclasses look it up
    spec.loader.exec_module(module)
    embedded = resolve_defaults(tyro.cli(module.Config, args=[]))
    given = resolve_defaults(tyro.cli(module.Config, args=["--model.path", "some/model"]))
    assert (embedded.actor.optim.lr, embedded.rollout.max_tokens, embedded.rollout.temperature,
            embedded.actor.max_tokens_per_micro_batch) == (1e-4, embedded_tokens, 1.0, 8192)
    # a real model's: what learned on SmolLM2-135M-Instruct (docs/real-model.md)
    assert (given.actor.optim.lr, given.rollout.max_tokens, given.rollout.temperature,
            given.actor.max_tokens_per_micro_batch) == (1e-5, given_tokens, 0.7, 1024)
    assert type(given.actor.optim.lr) is float and type(given.rollout.max_tokens) is int
    assert type(given.rollout.temperature) is float and type(given.actor.max_tokens_per_micro_batch) is int
    flagged = resolve_defaults(tyro.cli(module.Config, args=["--model.path", "m", "--actor.optim.lr", "3e-5"]))
    assert flagged.actor.optim.lr == 3e-5 and flagged.rollout.max_tokens == given_tokens


@pytest.mark.parametrize("recipe", ["grpo", "remax"])
def test_help_of_a_recipe_without_a_critic_never_mentions_one(recipe):
    """A shared flag's help (--trainer.placement's did) must not speak of a critic the recipe
    does not have; the recipe's own description may say it has none."""
    import os
    import re
    import subprocess
    import sys

    run = subprocess.run([sys.executable, str(RECIPES / f"{recipe}.py"), "--help"], capture_output=True,
                         text=True, timeout=120, env=os.environ | {"COLUMNS": "100"})
    assert run.returncode == 0, run.stderr
    flags = run.stdout[run.stdout.index("╭"):]   # the flags' boxes, after the description
    assert "--trainer.placement" in flags
    # the one allowed: critic/loss among the default console keys (shown when a recipe logs it)
    assert set(re.findall(r"\S*critic\S*", flags.lower())) <= {"critic/loss"}, flags


@pytest.mark.dist
@pytest.mark.parametrize("case", ["unknown flag", "batch does not divide", "missing file", "unsupported model",
                                  "overlong buffer"])
def test_bad_input_stops_before_work_with_a_message(case, tiny_model, tmp_path):
    args = small_run(tiny_model, tmp_path / "out")
    if case == "unknown flag":
        args += ["--actor.learning-rate", "1e-6"]
        expected = "--actor.learning-rate"
    elif case == "batch does not divide":
        args += ["--data.batch-size", "3", "--rollout.n", "1"]
        expected = "--data.batch-size 3"
    elif case == "overlong buffer":
        args += ["--algo.overlong-buffer", "9"]   # more than --rollout.max-tokens 4
        expected = "--algo.overlong-buffer 9"
    elif case == "missing file":
        args += ["--data.train-files", str(tmp_path / "nope.jsonl")]
        expected = "--data.train-files"
    else:
        bad = tmp_path / "gpt2"
        bad.mkdir()
        # a family the engine's transformers fallback cannot run either (docs/models.md)
        (bad / "config.json").write_text(json.dumps({"model_type": "mamba"}))
        args[1] = bad
        expected = "model_type 'mamba' is not supported"
    run = torchrun(str(RECIPES / "grpo.py"), 2, args, timeout=200)
    assert not run.timed_out, run.output
    assert run.returncode != 0, run.output
    assert expected in run.output, run.output
    assert not (tmp_path / "out" / "metrics.jsonl").exists()
