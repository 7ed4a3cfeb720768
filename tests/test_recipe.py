"""hflow.recipe_kit.set_up: the set-up every recipe calls, checked in-process (no ranks are started: a
stand-in cluster records what would be spawned), and the shared steps against hand formulas."""
from types import SimpleNamespace

import pytest
import torch

from hflow.batch import Batch
from hflow.recipe_kit.config import (ActorConfig, DataConfig, FSDPConfig, ModelConfig, OffPolicyConfig, RewardConfig,
                          RolloutConfig, TrainerConfig)
from hflow.default.model import build_default
from hflow.recipe_kit.set_up import OldLogProbs, gather, kl_to_reference, set_up, step_metrics
from hflow.validation import ConfigError


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_default(tmp_path_factory.mktemp("tiny") / "model", "tiny", seed=0)


class StandInCluster:
    """What set_up asks of a cluster, with nothing started."""
    device_type = "cpu"

    def __init__(self, world_size=2):
        self.world_size = world_size


class WarmUpRecorder:
    """An embedded default that records the warm-up instead of running it."""

    def __init__(self, base):
        self.base, self.warmed_up = base, False

    def base_model(self, model):
        return self.base

    def policy(self, cluster, model):
        self.warmed_up = True
        return self.base

    def judge(self, cluster, kind, model):
        raise AssertionError("no judge was asked for")


def config(**parts):
    cfg = SimpleNamespace(model=ModelConfig(), data=DataConfig(batch_size=4), reward=RewardConfig(),
                          actor=ActorConfig(), rollout=RolloutConfig(n=2), trainer=TrainerConfig(),
                          algo=SimpleNamespace(old_log_probs="auto"))
    for name, value in parts.items():
        setattr(cfg, name, value)
    return cfg


def test_set_up_checks_every_input_before_the_warm_up(tiny):
    default = WarmUpRecorder(tiny)
    # 3 prompts x 1 sample do not split over 2 ranks: refused, and the warm-up never ran
    with pytest.raises(ValueError, match="do not split over 2 ranks"):
        set_up(StandInCluster(2), config(data=DataConfig(batch_size=3), rollout=RolloutConfig(n=1)),
               [["actor"]], algo="grpo", default=default)
    with pytest.raises(ConfigError, match="unknown role 'critic'"):
        set_up(StandInCluster(2), config(trainer=TrainerConfig(placement="actor:0;critic:1")), [["actor"]],
               algo="grpo", default=default)
    with pytest.raises(ConfigError, match="--reward.model default is the embedded default policy's"):
        set_up(StandInCluster(2), config(model=ModelConfig(path=str(tiny)), reward=RewardConfig(model="default")),
               [["actor"]], algo="grpo", default=default)
    assert not default.warmed_up
    setup = set_up(StandInCluster(2), config(), [["actor"], ["ref"]], algo="grpo", default=default)
    assert default.warmed_up and setup.model_dir == str(tiny) and setup.reward_model is None
    assert setup.placement == {"actor": [0, 1], "ref": [0, 1]}
    assert setup.actor_cfg.model_path == str(tiny) and len(setup.train) > len(setup.val) == 500


def test_chat_prompts_to_the_embedded_default_are_warned_of(tiny, capsys):
    set_up(StandInCluster(2), config(data=DataConfig(batch_size=4, chat=True)), [["actor"]], algo="grpo",
           default=WarmUpRecorder(tiny))
    assert "--data.chat wraps every prompt in the chat template, which the embedded default" in capsys.readouterr().out
    set_up(StandInCluster(2), config(), [["actor"]], algo="grpo", default=WarmUpRecorder(tiny))
    assert "--data.chat" not in capsys.readouterr().out


def test_set_up_needs_a_model_when_the_recipe_has_no_default(tiny):
    with pytest.raises(ConfigError, match="--model.path is required"):
        set_up(StandInCluster(1), config(), [["actor"]], algo="grpo", default=None)
    setup = set_up(StandInCluster(1), config(model=ModelConfig(path=str(tiny))), [["actor"]], algo="grpo")
    assert setup.model_dir == str(tiny)


def test_set_up_checks_the_critic_batches_against_the_critics_ranks(tiny):
    cfg = config(critic=ActorConfig(mini_batch_size=3), trainer=TrainerConfig(placement="split"))
    with pytest.raises(ValueError, match="--critic.mini-batch-size 3"):
        set_up(StandInCluster(2), cfg, [["actor"], ["critic"]], algo="ppo", default=WarmUpRecorder(tiny))


@pytest.mark.parametrize("epochs,mini,choice,dtype,kl,expected", [
    (1, 0, "auto", "auto", False, "update"),           # on-policy, no KL in the reward: the update's own
    (1, 0, "recompute", "auto", False, "update"),      # ... whatever the flag says: nothing to compute
    (1, 0, "auto", "auto", True, "rollout"),           # a KL in the reward: fp32 on CPU, the engine's are exact
    (1, 0, "auto", "bfloat16", True, "recompute"),     # bf16: the engine's differ, recompute
    (2, 0, "auto", "auto", False, "rollout"),          # off-policy (two epochs)
    (1, 2, "recompute", "auto", False, "recompute"),   # off-policy (mini-batches), recompute asked
    (1, 2, "rollout", "bfloat16", False, "rollout"),   # the engine's, asked for in bf16
])
def test_where_the_old_log_probs_come_from(epochs, mini, choice, dtype, kl, expected):
    cfg = config(actor=ActorConfig(epochs=epochs, mini_batch_size=mini, fsdp=FSDPConfig(param_dtype=dtype)),
                 algo=SimpleNamespace(old_log_probs=choice))
    assert OldLogProbs.choose(cfg, "cpu", kl_in_reward=kl).source == expected


@pytest.mark.parametrize("epochs,choice,correction,dtype,kl,source,mode", [
    (1, "auto", "auto", "bfloat16", False, "update", "tis"),    # bf16: tis by default, on the update's own
    (1, "auto", "auto", "auto", False, "update", "none"),       # fp32: nothing to correct
    (1, "auto", "auto", "auto", True, "rollout", "none"),       # ... so the engine's are the old ones
    (1, "auto", "tis", "auto", True, "recompute", "tis"),       # asked for in fp32: measured against a pass
    (2, "auto", "mis", "bfloat16", False, "recompute", "mis"),
    (1, "recompute", "none", "bfloat16", True, "recompute", "none"),   # off: the gap is still measured
])
def test_the_rollout_correction_compares_the_engine_with_the_trainer(epochs, choice, correction, dtype, kl,
                                                                      source, mode):
    cfg = config(actor=ActorConfig(epochs=epochs, fsdp=FSDPConfig(param_dtype=dtype)),
                 algo=OffPolicyConfig(old_log_probs=choice, rollout_correction=correction))
    old = OldLogProbs.choose(cfg, "cpu", kl_in_reward=kl)
    assert (old.source, old.correction.mode) == (source, mode)
    assert old.correction.measured == (source != "rollout")   # the engine's own: nothing to compare


def test_a_rollout_correction_against_the_engines_own_log_probs_is_refused():
    with pytest.raises(ConfigError, match="use recompute or auto"):
        OldLogProbs.choose(config(algo=OffPolicyConfig(old_log_probs="rollout", rollout_correction="tis")), "cpu",
                           kl_in_reward=True)


def test_old_log_probs_from_the_rollout_are_the_engines_and_start_no_call():
    batch = Batch({"rollout_log_probs": torch.tensor([[-1.0, -2.0]]), "response_mask": torch.ones(1, 2)})
    assert OldLogProbs("rollout").pending(actor=None, batch=batch, temperature=1.0) == []
    assert torch.equal(batch["old_log_probs"], batch["rollout_log_probs"])
    assert OldLogProbs("update").pending(actor=None, batch=batch, temperature=1.0) == []

    class Actor:   # a recomputation is one log_probs call, returned to be waited on with the others
        class log_probs:
            @staticmethod
            def future(batch, temperature):
                return SimpleNamespace(result=lambda: Batch({"old_log_probs": torch.zeros(1, 2)}))
    pending = OldLogProbs("recompute").pending(Actor(), Batch({"response_mask": torch.ones(1, 2)}), 1.0)
    assert len(pending) == 1 and torch.equal(gather(Batch({"x": torch.ones(1)}), pending)["old_log_probs"],
                                             torch.zeros(1, 2))


def test_kl_to_reference_by_hand():
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    batch = Batch({"response_mask": mask, "rollout_log_probs": torch.tensor([[-1.0, -2.0, 5.0], [-0.5, 9.0, 9.0]]),
                   "ref_log_probs": torch.tensor([[-1.5, -1.0, 0.0], [-1.0, 0.0, 0.0]])})
    kl, mean = kl_to_reference(batch)   # on-policy: the engine's log-probs are the sampling policy's
    assert torch.equal(kl, torch.tensor([[0.5, -1.0, 0.0], [0.5, 0.0, 0.0]]))
    assert mean == pytest.approx((0.5 - 1.0 + 0.5) / 3)
    batch["old_log_probs"] = batch["ref_log_probs"]   # the old log-probs win when there are some
    assert kl_to_reference(batch)[1] == 0.0


def test_step_metrics_by_hand():
    batch = Batch({"response_mask": torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])})
    batch["finish_reason"] = ["length", "stop"]
    times = {"time/step_s": 2.0, "time/generate_s": 0.5}
    assert step_metrics(batch, times) == {
        "response_length/mean": 2.0, "response_length/max": 3.0, "response/stop_fraction": 0.5,
        "time/step_s": 2.0, "time/generate_s": 0.5, "throughput/tokens_per_s": 4 / 2.0}
    assert step_metrics(batch[:0], times) == times   # dynamic sampling kept nothing: times only


def test_prompts_that_leave_no_room_for_a_response_in_the_context_are_dropped_before_any_step(tiny, tmp_path):
    """A prompt shorter than --data.max-prompt-length but longer than the context allows used to
    pass and stop the run when its batch came up (`prompt 0 has 300 tokens; max_model_len is 256`)."""
    import json
    rows = [{"prompt": "12+35=", "answer": "47"}, {"prompt": "1+1=" * 60, "answer": "2"}, {"prompt": "9+9=", "answer": "18"}]
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = config(model=ModelConfig(path=str(tiny)), data=DataConfig(train_files=[str(data)], val_files=[str(data)],
                                                                   batch_size=2),
                 rollout=RolloutConfig(n=1, max_tokens=16, max_model_len=64))
    setup = set_up(StandInCluster(1), cfg, [["actor"]], algo="grpo")
    assert setup.train.ground_truths == ["47", "18"] and setup.train.num_dropped == 1
    assert setup.val.num_dropped == 1 and all(len(p) + 16 <= 64 for p in setup.train.prompt_ids)
    cfg.rollout = RolloutConfig(n=1, max_tokens=64, max_model_len=64)
    with pytest.raises(ConfigError, match="--rollout.max-tokens 64 leaves no room for a prompt"):
        set_up(StandInCluster(1), cfg, [["actor"]], algo="grpo")


def test_a_model_that_names_no_end_token_is_warned_about(tiny, tmp_path, capsys):
    import json
    import shutil
    silent = tmp_path / "silent"
    shutil.copytree(tiny, silent)
    for name in ("config.json", "generation_config.json"):
        data = json.loads((silent / name).read_text())
        data.pop("eos_token_id", None)
        (silent / name).write_text(json.dumps(data))
    set_up(StandInCluster(1), config(model=ModelConfig(path=str(tiny))), [["actor"]], algo="grpo")
    assert "end-of-sequence" not in capsys.readouterr().out
    set_up(StandInCluster(1), config(model=ModelConfig(path=str(silent))), [["actor"]], algo="grpo")
    assert "names no end-of-sequence token" in capsys.readouterr().out
