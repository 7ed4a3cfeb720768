"""Workers under the controller: the hybrid engine (resharded weights, sample log-probs),
critic and reward model against transformers, checkpoints."""
import pytest
from dist import torchrun
from test_fsdp import TESTS_ENV, tiny_model_dir

HYBRID = """
import sys, torch
import hflow
from hflow.batch import Batch
from hflow.dispatch import dispatch
from hflow.reshard import tensor_parallel_dim
from hflow.workers import Actor, ActorConfig, OptimConfig, RolloutConfig

path, tps = sys.argv[1], [int(t) for t in sys.argv[2].split(",")]


def pg_loss(logp, mb, entropy=None):
    mask = mb["response_mask"]
    return -(mb["advantages"] * logp * mask).sum() / mask.sum(), {}


class CheckedActor(Actor):
    @dispatch("all")
    def engine_vs_training(self) -> float:
        \"\"\"Largest difference between the engine's weights and full_tensor() of the training
        parameters, sliced as this rank's tensor-parallel shard.\"\"\"
        targets = self.rollout.llm.model.weight_targets()
        tp, t = self.rollout.gen_mesh.size(0), self.rollout.gen_mesh.get_local_rank(0)
        worst = 0.0
        for name, param in self.model.named_parameters():
            full = param.full_tensor()
            d = tensor_parallel_dim(name)
            expect = full if d is None else full.chunk(tp, d)[t]
            worst = max(worst, (targets[name][0] - expect).abs().max().item())
        return worst


def main(cluster, _):
    actor = cluster.spawn(CheckedActor, ActorConfig(model_path=path, optim=OptimConfig(lr=2e-2)))
    g = torch.Generator().manual_seed(0)
    prompts = Batch({"prompt_ids": [torch.randint(3, 101, (int(k),), generator=g).tolist()
                                    for k in torch.randint(1, 9, (6,), generator=g)],
                     "answer": [str(i) for i in range(6)]})
    for tp in tps:
        rollout = RolloutConfig(n=2, max_tokens=6, temperature=0.8, tp_size=tp, free_weights_when_asleep=False)
        batch = actor.generate(prompts, rollout)
        assert len(batch) == 12 and batch["answer"] == [str(i) for i in range(6) for _ in range(2)]
        assert batch.meta["n"] == 2 and batch.meta["temperature"] == 0.8
        # change the weights, then check the engine follows
        batch["advantages"] = torch.randn(batch["response_mask"].shape, generator=g)
        metrics = actor.update(batch, pg_loss)[0]
        assert set(metrics) == {"actor/loss", "actor/grad_norm", "actor/lr"}, metrics
        batch = actor.generate(prompts, rollout)
        worst = max(actor.engine_vs_training())
        mask = batch["response_mask"].bool()
        diff = (actor.log_probs(batch, 0.8)["old_log_probs"] - batch["rollout_log_probs"])[mask].abs().max()
        print(f"tp {tp}: engine vs training weights {worst:.2e}, log-prob diff {diff:.2e}", flush=True)
        assert worst == 0.0
        assert diff < 1e-4


if __name__ == "__main__":
    hflow.launch(main)
"""


@pytest.mark.dist
@pytest.mark.parametrize("world,tps", [(2, "1,2"), (4, "2")])
def test_engine_follows_training_weights(tmp_path, world, tps):
    """After an update the engine holds exactly the training weights (tp_g 1 and 2 on 2 ranks,
    2 on 4) and the log-probs it returns for its samples equal actor.log_probs."""
    path = tiny_model_dir(tmp_path / "model")
    run = torchrun(HYBRID, nproc=world, args=[path, tps], tmp_path=tmp_path, timeout=300,
                   env={**TESTS_ENV, "HFLOW_DEVICE": "cpu"}).check()
    assert run.output.count("log-prob diff") == len(tps.split(","))


MODELS = """
import sys, torch
import hflow
from transformers import AutoModelForSequenceClassification, AutoModelForTokenClassification
from safetensors.torch import load_file
from hflow.batch import Batch
from hflow.workers import (Actor, ActorConfig, Critic, CriticConfig, OptimConfig, RewardModel,
                           RewardModelConfig)
from hflow.workers.layout import position_ids
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
    assert set(metrics) == {"critic/loss", "critic/vf", "critic/grad_norm", "critic/lr"}, metrics

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
    assert actor.update(batch, pg_loss)[0] == after_save  # optimizer and schedule restored too
    print("checkpoint ok", flush=True)


if __name__ == "__main__":
    hflow.launch(main)
"""


def classifier_dir(path, kind, seed=1):
    """A random value model (token classifier) or reward model (sequence classifier)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForSequenceClassification, Qwen2ForTokenClassification

    torch.manual_seed(seed)
    config = Qwen2Config(vocab_size=101, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, num_labels=1,
                         classifier_dropout=0.0, pad_token_id=0, eos_token_id=1)
    Model = Qwen2ForTokenClassification if kind == "value" else Qwen2ForSequenceClassification
    Model(config).save_pretrained(str(path))
    return str(path)


@pytest.mark.dist
def test_critic_reward_and_checkpoints(tmp_path):
    actor = tiny_model_dir(tmp_path / "actor", shard=False)
    critic = classifier_dir(tmp_path / "critic", "value")
    reward = classifier_dir(tmp_path / "reward", "reward", seed=2)
    run = torchrun(MODELS, nproc=2, args=[actor, critic, reward, tmp_path], tmp_path=tmp_path,
                   timeout=300, env={**TESTS_ENV, "HFLOW_DEVICE": "cpu"}).check()
    assert "checkpoint ok" in run.output
