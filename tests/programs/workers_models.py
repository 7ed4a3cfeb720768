"""Critic and reward model vs transformers, actor checkpoints; run by test_workers.py::test_critic_reward_and_checkpoints."""
import sys, torch
import hflow
from transformers import AutoModelForSequenceClassification, AutoModelForTokenClassification
from safetensors.torch import load_file
from hflow.batch import Batch
from hflow.workers import (Actor, ActorConfig, Critic, CriticConfig, OptimConfig, RewardModel,
                           RewardModelConfig)
from hflow.layout import position_ids
from test_fsdp import random_rollouts

actor_path, critic_path, reward_path, out = sys.argv[1:5]


def value_loss(values, mb):
    mask = mb["response_mask"]
    return ((values - mb["returns"]) ** 2 * mask).sum() / mask.sum(), {"vf": values.mean()}


def pg_loss(logp, mb, entropy=None):
    mask = mb["response_mask"]
    return -(mb["advantages"] * logp * mask).sum() / mask.sum(), {}


def main(cluster, _):
    batch = Batch(random_rollouts(3, 2, 101, seed=5))
    mask = batch["response_mask"]
    R = mask.shape[1]
    L = batch["input_ids"].shape[1]
    inputs = dict(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                  position_ids=position_ids(batch["attention_mask"]))

    # a value model from a value-model checkpoint == transformers' forward
    critic = cluster.spawn(Critic, CriticConfig(model_path=critic_path, micro_batch_size=4))
    hf = AutoModelForTokenClassification.from_pretrained(critic_path, dtype=torch.float32)
    with torch.no_grad():
        expect = hf(**inputs).logits[:, L - R - 1:L - 1, 0] * mask
    got = critic.values(batch)["values"]
    print("critic", (got - expect).abs().max().item(), flush=True)
    torch.testing.assert_close(got, expect, rtol=0, atol=1e-5)
    batch["returns"] = torch.randn(mask.shape)
    metrics = critic.update(batch, value_loss)[0]
    assert set(metrics) == {"critic/loss", "critic/vf", "critic/grad_norm", "critic/lr", "critic/skipped_steps",
                            "memory/critic_peak_gib"}, metrics
    assert 0.05 < metrics["memory/critic_peak_gib"] < 64, metrics   # this process: its RSS, GiB

    # a value model started from the actor: the backbone is the actor's, the head new
    critic = cluster.spawn(Critic, CriticConfig(model_path=actor_path))
    critic.export_hf(out + "/critic")
    exported = AutoModelForTokenClassification.from_pretrained(out + "/critic", dtype=torch.float32)
    start = load_file(actor_path + "/model.safetensors")
    for name, value in exported.state_dict().items():
        if name.startswith("model."):
            torch.testing.assert_close(value, start[name], rtol=0, atol=0)
    assert exported.score.weight.abs().sum() > 0
    with torch.no_grad():
        expect = exported(**inputs).logits[:, L - R - 1:L - 1, 0] * mask
    torch.testing.assert_close(critic.values(batch)["values"], expect, rtol=0, atol=1e-5)

    # the reward model's score at the last response token == transformers' pooled output
    reward = cluster.spawn(RewardModel, RewardModelConfig(model_path=reward_path, micro_batch_size=2))
    hf = AutoModelForSequenceClassification.from_pretrained(reward_path, dtype=torch.float32)
    with torch.no_grad():
        expect = hf(**inputs).logits[:, 0]
    got = reward.scores(batch)["rm_scores"]
    print("reward", (got - expect).abs().max().item(), flush=True)
    torch.testing.assert_close(got, expect, rtol=0, atol=1e-5)

    # checkpoints: save, train on, load -> the saved weights (and optimizer) are back
    actor = cluster.spawn(Actor, ActorConfig(model_path=actor_path, optim=OptimConfig(lr=1e-2)))
    batch["advantages"] = torch.randn(mask.shape)
    actor.update(batch, pg_loss)
    saved = actor.log_probs(batch)["old_log_probs"]
    actor.save(out + "/ckpt")
    after_save = actor.update(batch, pg_loss)[0]
    assert not torch.equal(actor.log_probs(batch)["old_log_probs"], saved)
    actor.load(out + "/ckpt")
    torch.testing.assert_close(actor.log_probs(batch)["old_log_probs"], saved, rtol=0, atol=0)
    computed = lambda metrics: {k: v for k, v in metrics.items() if not k.startswith("memory/")}   # noqa: E731
    assert computed(actor.update(batch, pg_loss)[0]) == computed(after_save)  # optimizer and schedule restored too
    print("checkpoint ok", flush=True)


if __name__ == "__main__":
    hflow.launch(main)
