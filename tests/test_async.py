"""Asynchronous RL (hflow.recipe_kit.async_rollouts, hflow.distributed.weight_sync, workers/rollout.py): weights
pushed to a rollout group bit for bit, the staleness bound and the versions recorded, resume
equal to a run that never stopped, faults, and the flags that are refused."""
import re
import time
import uuid

import pytest

from dist import PROGRAMS, run_ranks, torchrun
from hflow.recipe_kit.async_rollouts import rollout_sets
from hflow.validation import ConfigError
from hflow.distributed.weight_sync import buckets, joint_ranks
from test_faults import BOUND_S, processes_with
from test_recipes import (RECIPES, assert_resumed_equals_straight, rows, small_run,  # noqa: F401 (fixture)
                          tiny_model)

# the tiny policy's groups mix, and a step it can see: every update moves the policy
PARITY = ("--reward.fn", "dapo_rewards:length_parity", "--actor.optim.lr", "1e-3")
ASYNC_SPLIT = ("--trainer.placement", "split")


def test_buckets_cut_the_manifest_in_order_and_a_large_tensor_goes_alone():
    manifest = [("a", (2, 3)), ("b", (4,)), ("big", (100,)), ("c", (1,)), ("d", (5,))]   # 6, 4, 100, 1, 5 elements
    assert buckets(manifest, 4, 40) == [[0, 1], [2], [3, 4]]
    assert buckets(manifest, 4, 10**6) == [[0, 1, 2, 3, 4]]
    assert buckets(manifest, 2, 20) == [[0, 1], [2], [3, 4]]
    with pytest.raises(ValueError, match="bucket_bytes"):
        buckets(manifest, 4, 0)


def test_the_push_group_joins_the_actor_source_to_rollout_ranks_it_is_not_among():
    assert joint_ranks(2, [0, 1]) == [0, 1, 2]
    with pytest.raises(ValueError, match="ranks of its own"):
        joint_ranks(1, [1, 2])


def test_a_rollout_set_is_added_only_when_the_run_has_one():
    sets = [["actor"], ["ref"]]
    assert rollout_sets(sets, "colocate", 0) == sets
    assert rollout_sets(sets, "split", 1) == [["actor"], ["ref"], ["rollout"]]
    assert rollout_sets(sets, "actor,ref:0;rollout:1", 0) == [["actor"], ["ref"], ["rollout"]]   # synchronous split
    assert rollout_sets(sets, "auto", 2) == [["actor"], ["ref"], ["rollout"]]   # auto sizes the groups
    with pytest.raises(ConfigError, match="--trainer.placement colocate does not place one"):
        rollout_sets(sets, "colocate", 2)


@pytest.mark.dist
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_pushed_weights_equal_the_actors_bit_for_bit_after_every_update(tiny_model, dtype):
    """Actor FSDP-sharded on ranks 0-1, rollout group on 2-3; one big bucket, then 4 KiB ones."""
    run = torchrun(f"{PROGRAMS}/async_push.py", 4, [tiny_model, dtype], timeout=300).check()
    assert run.output.count("equal bit for bit on ranks [2, 3]") == 3, run.output


def staleness_run(model, out, k, steps=5, *extra):
    torchrun(str(RECIPES / "grpo.py"), 2, small_run(model, out, steps, "--trainer.no-export", *PARITY,
                                                    "--trainer.async-steps", k, *ASYNC_SPLIT, *extra),
             timeout=400, env={"PYTHONPATH": PROGRAMS}).check()
    return rows(out)[1:]


@pytest.mark.dist
@pytest.mark.parametrize("k", [1, 2])
def test_samples_are_at_most_k_versions_stale_and_record_their_version(tiny_model, tmp_path, k):
    logged = staleness_run(tiny_model, tmp_path / "out", k)
    for row in logged:
        step = row["step"]
        version = max(0, step - k - 1)   # issued after the push of the latest version
        assert row["async/policy_version"] == version, row
        assert row["async/staleness_max"] == row["async/staleness_mean"] == step - 1 - version <= k
        assert row["async/dropped_stale"] == 0
        # the trainer's policy is ahead of the engine's once the samples are stale: the correction weighs them
        assert "actor/mismatch/is_weight_mean" in row
    assert any(row["actor/grad_norm"] > 0 for row in logged)
    stale = [row for row in logged if row["async/staleness_max"] > 0]
    assert stale and all(row["actor/mismatch/abs_log_ratio_max"] > 1e-3 for row in stale), stale
    fresh = [row for row in logged if row["async/staleness_max"] == 0]
    assert all(row["actor/mismatch/abs_log_ratio_max"] < 1e-5 for row in fresh), fresh   # fp32: the same policy


@pytest.mark.dist
def test_a_rollout_group_of_two_ranks_generates_each_step_between_them(tiny_model, tmp_path):
    out = tmp_path / "out"
    torchrun(str(RECIPES / "grpo.py"), 3, small_run(tiny_model, out, 3, "--trainer.no-export", *PARITY,
                                                    "--trainer.async-steps", 1, "--trainer.placement",
                                                    "actor:0;rollout:1-2"),
             timeout=400, env={"PYTHONPATH": PROGRAMS}).check()
    logged = rows(out)[1:]
    assert [row["async/policy_version"] for row in logged] == [0, 0, 1]
    assert all(row["time/rollout_busy_s"] > 0 and len({row["reward/mean"]}) == 1 for row in logged)


@pytest.mark.dist
def test_auto_places_an_async_run_on_a_training_and_a_rollout_group(tiny_model, tmp_path):
    out = tmp_path / "out"
    run = torchrun(str(RECIPES / "grpo.py"), 2, small_run(tiny_model, out, 3, "--trainer.no-export", *PARITY,
                                                          "--trainer.async-steps", 1, "--trainer.placement", "auto"),
                   timeout=400, env={"PYTHONPATH": PROGRAMS}).check()
    assert "placement auto: asynchronous grpo on 2 x cpu" in run.output, run.output[-3000:]
    assert "chose training on ranks 0, rollout on ranks 1" in run.output, run.output[-3000:]
    assert [row["async/policy_version"] for row in rows(out)[1:]] == [0, 0, 1]


@pytest.mark.dist
def test_async_zero_is_a_synchronous_step_on_a_rollout_group_of_its_own(tiny_model, tmp_path):
    logged = staleness_run(tiny_model, tmp_path / "out", 0, 3, "--trainer.placement", "actor:0;rollout:1")
    assert [row["async/policy_version"] for row in logged] == [0, 1, 2]
    assert all(row["async/staleness_max"] == 0 and row["actor/mismatch/abs_log_ratio_max"] < 1e-5 for row in logged)


@pytest.mark.dist
def test_ppo_trains_on_samples_one_version_stale_with_its_critic_beside_the_actor(tiny_model, tmp_path):
    out = tmp_path / "ppo"
    torchrun(str(RECIPES / "ppo.py"), 2, small_run(tiny_model, out, 4, "--trainer.no-export", *PARITY,
                                                   "--algo.critic-warmup", 0, "--trainer.async-steps", 1,
                                                   "--trainer.placement", "actor,ref,critic:0;rollout:1"),
             timeout=400, env={"PYTHONPATH": PROGRAMS}).check()
    logged = rows(out)[1:]
    assert [row["async/policy_version"] for row in logged] == [0, 0, 1, 2]
    assert [row["async/staleness_max"] for row in logged] == [0, 1, 1, 1]
    assert all("critic/loss" in row and "actor/mismatch/is_weight_mean" in row for row in logged)


@pytest.mark.dist
def test_a_resumed_async_run_trains_on_the_samples_the_uninterrupted_one_did(tiny_model, tmp_path):
    """The checkpoint after step 2 holds steps 3 and 4's generated batches; the resumed run takes
    them, then generates on as the straight run did (same prompts, seeds and weights)."""
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    common = ("--trainer.no-export", *PARITY, "--trainer.async-steps", 2, *ASYNC_SPLIT)
    env = {"PYTHONPATH": PROGRAMS}
    torchrun(str(RECIPES / "grpo.py"), 2, small_run(tiny_model, straight, 5, *common), timeout=400, env=env).check()
    torchrun(str(RECIPES / "grpo.py"), 2, small_run(tiny_model, resumed, 2, "--trainer.save-every", 2, *common),
             timeout=400, env=env).check()
    torchrun(str(RECIPES / "grpo.py"), 2, small_run(tiny_model, resumed, 5, "--trainer.resume", *common),
             timeout=400, env=env).check()
    assert_resumed_equals_straight(rows(straight), rows(resumed), interrupted_at=2)


@pytest.mark.dist
@pytest.mark.faults
@pytest.mark.parametrize("fault", ["generate:1:kill", "handoff:1:kill", "update:0:kill", "generate:1:stop"])
def test_a_fault_in_either_group_ends_the_async_run_within_the_bound(tiny_model, tmp_path, fault):
    """Rank 0 trains, rank 1 generates: a fault on either side (the rollout's engine, its end of
    a push, the actor's update) ends every rank non-zero within the bound of synchronous runs."""
    marker = uuid.uuid4().hex
    run = run_ranks(str(RECIPES / "grpo.py"), 2, tmp_path=tmp_path, timeout=300,
                    args=small_run(tiny_model, tmp_path / "out", 4, *PARITY, "--trainer.async-steps", 1,
                                   *ASYNC_SPLIT),
                    env={"HFLOW_FAULT": fault, "HFLOW_TEST_RUN": marker, "PYTHONPATH": PROGRAMS})
    assert not run.timed_out, run.output
    hit = re.search(r"HFLOW_FAULT: rank \d \S+ at \S+ #1 T (\S+)", run.output)
    assert hit, run.output
    assert all(code != 0 for code in run.returncodes), run.output
    assert max(run.ended_at) - float(hit.group(1)) < BOUND_S, run.output
    # the reward pool's helpers (multiprocessing's resource tracker, a spawned scorer) end once their
    # parent's pipes close: each must be gone within the bound too
    while (left := processes_with(f"HFLOW_TEST_RUN={marker}")) and time.time() < float(hit.group(1)) + BOUND_S:
        time.sleep(0.2)
    assert left == [], f"processes left behind: {left}"


@pytest.mark.dist
@pytest.mark.parametrize("case", ["colocate", "dynamic sampling", "remax"])
def test_async_flags_a_run_cannot_honour_are_refused_before_work(tiny_model, tmp_path, case):
    recipe, extra = "grpo", ["--trainer.async-steps", "1"]
    if case == "colocate":
        expected = "--trainer.placement colocate does not place one"
    elif case == "dynamic sampling":
        extra += [*ASYNC_SPLIT, "--algo.dynamic-sampling"]
        expected = "--algo.dynamic-sampling"
    else:
        recipe, expected = "remax", "this recipe generates on the actor's ranks only"
        extra += [*ASYNC_SPLIT]
    run = torchrun(str(RECIPES / f"{recipe}.py"), 2, small_run(tiny_model, tmp_path / "out", 2, *extra), timeout=200)
    assert run.returncode != 0 and expected in run.output, run.output
