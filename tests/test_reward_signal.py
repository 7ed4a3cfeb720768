"""hflow.scoring.Rewards warns when the first batches carry no signal (every response scored the
same), the new user's silent failure, and stays quiet once scores differ."""
from transformers import AutoTokenizer

from hflow.config import RewardConfig
from hflow.default.model import build_default
from hflow.scoring import Rewards
from hflow.layout import sequence_tensors
from hflow.batch import Batch


def rollout(tokenizer, responses: list[str], answers: list[int]) -> Batch:
    prompts = [tokenizer.encode("12+30=", add_special_tokens=False)] * len(responses)
    ids = [tokenizer.encode(r, add_special_tokens=False) + [tokenizer.eos_token_id] for r in responses]
    batch = Batch(sequence_tensors(prompts, ids, tokenizer.pad_token_id or tokenizer.eos_token_id))
    batch["ground_truth"], batch["extra"] = answers, [{} for _ in responses]
    return batch


def test_equal_scores_in_the_first_batches_warn_once(tmp_path, capsys):
    tokenizer = AutoTokenizer.from_pretrained(build_default(tmp_path / "m", "tiny"))
    rewards = Rewards(None, RewardConfig(fn="arithmetic"), tokenizer)
    wrong = rollout(tokenizer, ["5", "7"], [42, 42])
    for _ in range(3):
        scores, _ = rewards(wrong)
        assert scores.tolist() == [0.0, 0.0]
    out = capsys.readouterr().out
    assert out.count("hflow: warning: every response scored 0 in each of the first 3 batches") == 1
    assert "drop --data.chat" in out
    rewards(wrong)
    assert "warning" not in capsys.readouterr().out          # said once
    rewards.close()


def test_a_batch_with_a_signal_silences_the_warning(tmp_path, capsys):
    tokenizer = AutoTokenizer.from_pretrained(build_default(tmp_path / "m", "tiny"))
    rewards = Rewards(None, RewardConfig(fn="arithmetic"), tokenizer)
    rewards(rollout(tokenizer, ["42", "7"], [42, 42]))       # one right, one wrong
    for _ in range(4):
        rewards(rollout(tokenizer, ["5", "7"], [42, 42]))
    assert "warning" not in capsys.readouterr().out
    rewards.close()


def test_a_reward_module_that_is_not_importable_says_how_to_fix_sys_path():
    import pytest
    from hflow.rewards import get_reward_fn
    with pytest.raises(ValueError, match="cannot import module 'mymod_not_here'.*PYTHONPATH=."):
        get_reward_fn("mymod_not_here:score")
