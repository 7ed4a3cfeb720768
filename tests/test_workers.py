"""Workers under the controller: the hybrid engine (resharded weights, sample log-probs),
critic and reward model against transformers, checkpoints."""
import os

import pytest
from dist import PROGRAMS, torchrun
from test_fsdp import TESTS_ENV, tiny_model_dir


HYBRID = os.path.join(PROGRAMS, "workers_hybrid.py")


@pytest.mark.dist
@pytest.mark.parametrize("world,tps", [(2, "1,2"), (4, "2")])
def test_engine_follows_training_weights(tmp_path, world, tps):
    """After an update the engine holds exactly the training weights (tp_g 1 and 2 on 2 ranks,
    2 on 4) and the log-probs it returns for its samples equal actor.log_probs."""
    path = tiny_model_dir(tmp_path / "model")
    run = torchrun(HYBRID, nproc=world, args=[path, tps], tmp_path=tmp_path, timeout=300,
                   env={**TESTS_ENV, "HFLOW_DEVICE": "cpu"}).check()
    assert run.output.count("log-prob diff") == len(tps.split(","))


MODELS = os.path.join(PROGRAMS, "workers_models.py")


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
