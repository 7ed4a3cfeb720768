"""Asynchronous multi-turn agents: each model turn's policy version recorded (workers/agent_rollout.py),
weights loaded between engine steps continuing the trajectories in flight (a partial rollout),
the per-turn staleness figures (hflow.recipe_kit.async_rollouts.turn_staleness), and
recipes/agent.py with --trainer.async-steps on a rollout rank of its own."""
import json
from pathlib import Path

import pytest
import torch

from hflow.agents import AgentLimits, Segment, Trajectory
from hflow.batch import Batch
from hflow.default.model import build_default
from hflow.recipe_kit.async_rollouts import turn_staleness
from hflow.workers.agent_rollout import sample_agent, version_columns
from hflow.workers.rollout_batches import RolloutConfig
from test_agent_rollout import FixedTurns, engine, ending_turns_model, forward_log_probs, rows

RECIPE = str(Path(__file__).resolve().parents[1] / "recipes" / "agent.py")


def turn(ids, versions):
    return Segment(list(ids), [-0.5] * len(ids), versions)


def test_version_columns_per_row_token_and_turn():
    """Turn 1 by version 0, turn 2 by 1, turn 3 begun by 1 and finished by 2 (a load within it);
    observations carry the version of the turn before them; a trajectory with no model turn
    (failed at reset) is the version the rollout began with."""
    t = Trajectory([1, 2], [turn([5, 6, 7], [0, 0, 0]), Segment([8, 9], None), turn([10, 11], [1, 1]),
                            Segment([12], None), turn([13, 14, 15], [1, 2, 2])])
    failed = Trajectory([1], [Segment([0], None)])
    cols = version_columns([t, failed], start=3, response_len=12, max_turns=4)
    assert cols["policy_version"].tolist() == [0, 3]
    assert cols["token_policy_version"].tolist() == [[0, 0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 3], [3] * 12]
    assert cols["turn_policy_version"].tolist() == [[0, 1, 1, -1], [-1, -1, -1, -1]]


def test_turn_staleness_counts_each_turn_against_the_trainers_version():
    """At step 3 the trainer is version 2: turns by 0, 1, 1 are 2, 1, 1 behind; the second row's one
    turn by 2 is 0 behind. Only the first row's tokens come from several versions."""
    t = Trajectory([1, 2], [turn([5, 6], [0, 0]), Segment([8], None), turn([10], [1]), Segment([12], None),
                            turn([13, 14], [1, 2])])
    u = Trajectory([1, 2], [turn([5, 6, 7], [2, 2, 2])])
    cols = version_columns([t, u], start=0, response_len=7, max_turns=3)
    mask = torch.tensor([[1, 1, 0, 1, 0, 1, 1], [1, 1, 1, 0, 0, 0, 0]])
    metrics = turn_staleness(Batch({**cols, "response_mask": mask}), step=3)
    assert metrics == {"async/turn_staleness_mean": pytest.approx(1.0), "async/turn_staleness_max": 2.0,
                       "async/mixed_version_fraction": 0.5}


@pytest.fixture(scope="module")
def two_policies(tmp_path_factory):
    """The tiny default ending its turns early (test_agent_rollout), from two seeds: the weights of
    version 0 and version 1."""
    root = tmp_path_factory.mktemp("two_policies")
    return [ending_turns_model(build_default(root / f"base{s}", "tiny", seed=s), root / f"eot{s}") for s in (0, 1)]


def test_weights_loaded_mid_rollout_continue_the_trajectories_and_each_token_says_which_sampled_it(two_policies):
    """A partial rollout as Rollout.generate_agent runs it: after a few engine steps the engine is
    given version 1's weights (between_steps). Each model token's recorded version is the one whose
    forward gives its log-prob (transformers' model as the oracle), turns queued after the load
    begin on version 1, some trajectory has turns of both versions, and a load while the engine
    is idle (every session at its tools) is taken too."""
    from transformers import AutoModelForCausalLM
    from hflow.workers import packing
    first, second = two_policies
    llm = engine(first)
    state = {"version": 0, "calls": 0}
    weights = AutoModelForCausalLM.from_pretrained(second, dtype=torch.float32).state_dict()

    def between_steps():   # as Rollout._take_offered: the next version, at the 6th call
        state["calls"] += 1
        if state["calls"] == 6:
            llm.load_weights(weights.items())
            state["version"] = 1

    limits = AgentLimits(max_turns=6, max_response_tokens=160, max_turn_tokens=32)
    batch = sample_agent(llm, rows(4), FixedTurns, RolloutConfig(n=2, seed=7, progress=False), limits,
                         _tokenizer(first), 0, None, version=lambda: state["version"], between_steps=between_steps)
    assert state["version"] == 1
    mask = batch["response_mask"].bool()
    versions = batch["token_policy_version"]
    turns = batch["turn_policy_version"]
    assert set(versions[mask].tolist()) == {0, 1}
    assert (batch["policy_version"] == turns[:, 0]).all() and (turns[:, 0] == 0).all()
    real = turns >= 0
    assert (turns[:, 1:][real[:, 1:]] >= turns[:, :-1][real[:, 1:]]).all(), turns   # never back to an older version
    assert (turns[:, 1:] == 1).any(), turns
    mixed = turn_staleness(batch, step=2)["async/mixed_version_fraction"]
    assert 0 < mixed <= 1, mixed
    # the oracle: each token's log-prob is its version's forward's
    logps = []
    for path in two_policies:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                     attn_implementation=packing.register_attention())
        with torch.no_grad():
            logps.append(forward_log_probs(model, batch))
    engine_logp = batch["rollout_log_probs"]
    for v in (0, 1):
        at = mask & (versions == v)
        assert (engine_logp[at] - logps[v][at]).abs().max() < 1e-4, v
        assert (engine_logp[at] - logps[1 - v][at]).abs().max() > 1e-2, v   # the oracle tells them apart
    print({k: round(x, 3) for k, x in turn_staleness(batch, step=2).items()}, int(mask.sum()), "model tokens")


def _tokenizer(path):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(path)


def test_without_a_version_the_batch_has_no_version_columns(two_policies):
    batch = sample_agent(engine(two_policies[0]), rows(2), FixedTurns, RolloutConfig(n=1, seed=7, progress=False),
                         AgentLimits(max_turns=3, max_response_tokens=64, max_turn_tokens=16),
                         _tokenizer(two_policies[0]), 0, None)
    assert not {"policy_version", "token_policy_version", "turn_policy_version"} & set(batch.keys())


def metrics_rows(out) -> list[dict]:
    return [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.dist
@pytest.mark.parametrize("partial", [False, True])
def test_agent_recipe_async_one_step_ahead_counts_staleness_per_turn(tmp_path, partial):
    """recipes/agent.py on the embedded default (its calculator task), the actor on rank 0 and the
    rollout group on rank 1, one step ahead: step 1 trains on version 0's trajectories (0 stale),
    steps 2 and 3 on version 0's and 1's (1 stale); per turn the same, since a turn's weights are
    its trajectory's unless a partial rollout changed them (then never older than its row's)."""
    from dist import torchrun
    out = tmp_path / "out"
    args = ["--trainer.output-dir", out, "--trainer.steps", 3, "--data.batch-size", 4, "--rollout.n", 2,
            "--trainer.eval-size", 4, "--trainer.eval-every", 0, "--trainer.logging.no-progress-bars",
            "--trainer.no-export", "--trainer.async-steps", 1, "--trainer.placement", "split",
            *(["--trainer.partial-rollouts"] if partial else [])]
    run = torchrun(RECIPE, 2, args, timeout=600)
    run.check()
    logged = [r for r in metrics_rows(out) if "async/staleness_max" in r]
    assert [r["step"] for r in logged] == [1, 2, 3], run.output[-3000:]
    for r in logged:
        print({k: v for k, v in r.items() if k.startswith(("async/", "time/step", "agent/turns"))})
        expected = min(r["step"] - 1, 1)
        assert r["async/staleness_max"] <= expected and r["async/dropped_stale"] == 0
        assert 0 <= r["async/turn_staleness_mean"] <= r["async/turn_staleness_max"] <= expected
        assert r["async/turn_staleness_mean"] <= r["async/staleness_mean"] + 1e-9   # turns never older than rows
        if not partial:
            assert r["async/staleness_max"] == expected and r["async/policy_version"] == max(0, r["step"] - 2)
            assert r["async/turn_staleness_max"] == r["async/turn_staleness_mean"] == expected
            assert r["async/mixed_version_fraction"] == 0
        assert "actor/mismatch/is_weight_mean" in r and "agent/turns" in r
    first = logged[0]
    assert first["async/turn_staleness_mean"] == first["async/turn_staleness_max"] == 0
