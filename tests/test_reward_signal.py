"""hflow.recipe_kit.scoring.Rewards warns when the first batches carry no signal (every response scored the
same), the new user's silent failure, and stays quiet once scores differ."""
import pytest
from transformers import AutoTokenizer

from hflow.recipe_kit.config import RewardConfig
from hflow.default.model import build_default
from hflow.recipe_kit.scoring import Rewards, ScoringFailed
from hflow.layout import sequence_tensors
from hflow.batch import Batch


def returns_nothing(response, ground_truth, **extra):
    """A broken reward function: it forgets to return."""
    return None


def only_42(response, ground_truth, **extra):
    """Fails on every response but "42"."""
    return 1.0 if response == "42" else None


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


def test_a_reward_that_fails_on_every_response_stops_the_run_after_the_set_number_of_batches(tmp_path, capsys):
    tokenizer = AutoTokenizer.from_pretrained(build_default(tmp_path / "m", "tiny"))
    rewards = Rewards(None, RewardConfig(fn="test_reward_signal:returns_nothing", inline=True, max_failed_batches=3), tokenizer)
    batch = rollout(tokenizer, ["5", "7"], [42, 42])
    for _ in range(2):
        scores, metrics = rewards(batch)
        assert scores.tolist() == [0.0, 0.0] and metrics["reward/errors"] == 2.0
    with pytest.raises(ScoringFailed, match=r"failed on every response of 3 batches in a row \(2 of 2 in the last; "
                                            r"first: ValueError: score function returned NoneType"):
        rewards(batch)
    # the warning about prompts in the wrong format would blame the wrong thing: not given
    assert "every response scored 0" not in capsys.readouterr().out


def test_one_scored_response_resets_the_count_and_0_never_stops(tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(build_default(tmp_path / "m", "tiny"))
    broken, working = rollout(tokenizer, ["5", "7"], [42, 42]), rollout(tokenizer, ["42", "7"], [42, 42])
    rewards = Rewards(None, RewardConfig(fn="test_reward_signal:only_42", inline=True, max_failed_batches=2), tokenizer)
    for batch in (broken, working, broken, working, broken):
        rewards(batch)          # never two failed batches in a row
    never = Rewards(None, RewardConfig(fn="test_reward_signal:returns_nothing", inline=True, max_failed_batches=0), tokenizer)
    for _ in range(5):
        never(broken)
