"""Reward and cost models: the losses and pair accuracy by hand, preference data layouts, the
trainable worker and its export against transformers, recipes/reward_model.py, and PPO with a
reward model in the loop (colocated and split)."""
import json
import math
import os
from pathlib import Path

import pytest
import torch

from dist import PROGRAMS, torchrun
from hflow.recipe_kit.config import ModelConfig
from hflow.data import DataError
from hflow.data.preference import (PairDataConfig, arithmetic_preference_rows, pair_batch, pair_tokens,
                                   read_pair_rows, tokenize_pairs)
from hflow.default.model import build_default
from hflow.algos import bradley_terry_loss, cost_model_loss, pair_loss, pair_metrics
from hflow.recipe_kit.set_up import scorer_flag_problems
from hflow.recipe_kit.scoring import check_same_tokenizer, reward_roles
from hflow.rewards import RewardConfig
from hflow.rewards.arithmetic import arithmetic_score
from test_fsdp import TESTS_ENV, tiny_model_dir

RECIPES = Path(__file__).resolve().parents[1] / "recipes"
sigmoid = lambda x: 1 / (1 + math.exp(-x))   # noqa: E731


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return build_default(tmp_path_factory.mktemp("tiny") / "model", "tiny", seed=0)


# ---------------------------------------------------------------- losses and metrics by hand

def test_bradley_terry_loss_by_hand():
    chosen, rejected = torch.tensor([1.0, -0.5, 2.0]), torch.tensor([0.0, 0.5, 2.0])
    by_hand = -(math.log(sigmoid(1.0)) + math.log(sigmoid(-1.0)) + math.log(sigmoid(0.0))) / 3
    assert bradley_terry_loss(chosen, rejected).item() == pytest.approx(by_hand, rel=1e-6)
    # centering adds lambda * mean of the squared scores / 2, whatever the ranking
    centred = by_hand + 0.1 * ((1 + 0) + (0.25 + 0.25) + (4 + 4)) / 3 / 2
    assert bradley_terry_loss(chosen, rejected, center_coef=0.1).item() == pytest.approx(centred, rel=1e-6)
    # a huge margin stays finite (log-sigmoid, not log of a rounded sigmoid)
    assert bradley_terry_loss(torch.tensor([-200.0]), torch.tensor([200.0])).item() == pytest.approx(400.0)


def test_cost_model_loss_by_hand():
    # pair 1: safer (safe) costs -1, unsafer (unsafe) costs 2; pair 2: both safe, 0.5 and -0.3
    safer, unsafer = torch.tensor([-1.0, 0.5]), torch.tensor([2.0, -0.3])
    safer_safe, unsafer_safe = torch.tensor([1.0, 1.0]), torch.tensor([0.0, 1.0])
    pair1 = -math.log(sigmoid(2.0 - -1.0)) - math.log(sigmoid(-1 * -1.0)) - math.log(sigmoid(+1 * 2.0))
    pair2 = -math.log(sigmoid(-0.3 - 0.5)) - math.log(sigmoid(-1 * 0.5)) - math.log(sigmoid(-1 * -0.3))
    got = cost_model_loss(safer, unsafer, safer_safe, unsafer_safe).item()
    assert got == pytest.approx((pair1 + pair2) / 2, rel=1e-6)


def test_pair_accuracy_and_margin():
    scores = torch.tensor([2.0, 1.0, 0.0, 3.0, 1.0, 1.0, 5.0, -1.0])   # chosen, rejected, ...
    # right, wrong, a tie (wrong), right
    assert pair_metrics(scores) == {"accuracy": 0.5, "margin": pytest.approx((1 - 3 + 0 + 6) / 4)}
    # a cost model ranks the other way: the chosen (safer) response should cost less
    safe = torch.tensor([1.0, 0.0, 1.0, 0.0, 1.0, 1.0, 0.0, 0.0])
    cost = pair_metrics(scores, safe, cost=True)
    assert cost["accuracy"] == 0.25 and cost["margin"] == pytest.approx(-1.0)
    # cost > 0 <=> unsafe: right for unsafe rows 1, 3, 6 (> 0) and safe row 2 (0 is not > 0)
    assert cost["sign_accuracy"] == 4 / 8


def test_pair_loss_wants_the_pair_layout_and_safety_labels():
    batch = pair_batch([([5], [6, 2], [7, 2], True, False)], pad_id=0)
    loss, metrics = pair_loss(torch.tensor([1.0, 0.0]), batch)
    assert loss.item() == pytest.approx(-math.log(sigmoid(1.0))) and metrics["accuracy"] == 1.0
    loss, metrics = pair_loss(torch.tensor([-1.0, 1.0]), batch, cost=True)
    # chosen = safer (safe, s = -1) costs -1, rejected (unsafe, s = +1) costs 1
    assert loss.item() == pytest.approx(-math.log(sigmoid(2.0)) - 2 * math.log(sigmoid(1.0)), rel=1e-6)
    assert metrics["sign_accuracy"] == 1.0
    swapped = {**batch.tensors, "chosen": torch.tensor([0.0, 1.0])}
    with pytest.raises(ValueError, match="pair layout"):
        pair_loss(torch.tensor([1.0, 0.0]), swapped)
    with pytest.raises(ValueError, match="--data.chosen-safe-key"):
        pair_loss(torch.tensor([1.0, 0.0]), pair_batch([([5], [6], [7], None, None)], 0), cost=True)


# ---------------------------------------------------------------- data

def test_arithmetic_pairs_prefer_the_right_answer_over_a_wrong_one():
    for split in ("train", "val"):
        rows = arithmetic_preference_rows(split, seed=0)
        assert len(rows) == (500 if split == "val" else 12195 - 500)
        for row in rows:
            answer = str(eval(row["prompt"][:-1]))
            assert row["chosen"] == answer and arithmetic_score(row["chosen"], answer) == 1.0
            assert arithmetic_score(row["rejected"], answer) == 0.0, row
    assert arithmetic_preference_rows("val", 0) == arithmetic_preference_rows("val", 0)
    # a policy's own mistakes on a prompt each make one more pair, after the built-in one
    prompt = arithmetic_preference_rows("val", 0)[0]["prompt"]
    rows = arithmetic_preference_rows("val", 0, mistakes={prompt: ["7", "7"], "not a prompt": ["1"]})
    assert len(rows) == 502 and [r["rejected"] for r in rows[1:3]] == ["7", "7"]
    assert rows[0] == arithmetic_preference_rows("val", 0)[0]
    # near misses: the answer - 10, - 1, + 1, + 10 after the built-in one, those below 0 left out
    rows = arithmetic_preference_rows("val", 0, near_misses=True)
    assert rows[0]["prompt"] == "36-31=" and [r["rejected"] for r in rows[1:4]] == ["4", "6", "15"]
    assert all(arithmetic_score(r["rejected"], r["chosen"]) == 0.0 for r in rows)
    assert len(rows) == 500 + sum(len([x for x in (-10, -1, 1, 10) if int(r["chosen"]) + x >= 0])
                                  for r in arithmetic_preference_rows("val", 0))
    train_prompts = {r["prompt"] for r in arithmetic_preference_rows("train", 0)}
    assert not train_prompts & {r["prompt"] for r in arithmetic_preference_rows("val", 0)}


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_pku_saferlhf_layout_swaps_by_the_preferred_column(tmp_path):
    rows = [{"prompt": "p0", "response_0": "a", "response_1": "b", "better_response_id": 1,
             "safer_response_id": 0, "is_response_0_safe": True, "is_response_1_safe": False}] * 20
    files = [write_jsonl(tmp_path / "pku.jsonl", rows)]
    pku = dict(train_files=files, val_files=files, chosen_key="response_0", rejected_key="response_1")
    better = read_pair_rows(PairDataConfig(**pku, preferred_key="better_response_id"), "val")
    assert better[0] == {"prompt": "p0", "chosen": "b", "rejected": "a"}
    safer = read_pair_rows(PairDataConfig(**pku, preferred_key="safer_response_id", chosen_safe_key="is_response_0_safe",
                                          rejected_safe_key="is_response_1_safe"), "val", cost=True)
    assert safer[0] == {"prompt": "p0", "chosen": "a", "rejected": "b", "chosen_safe": True, "rejected_safe": False}
    # the safety labels follow their response when the preferred one is the second
    swapped = [{**rows[0], "safer_response_id": 1, "is_response_0_safe": False, "is_response_1_safe": True}]
    write_jsonl(tmp_path / "pku.jsonl", swapped)
    again = read_pair_rows(PairDataConfig(**pku, preferred_key="safer_response_id", chosen_safe_key="is_response_0_safe",
                                          rejected_safe_key="is_response_1_safe"), "val", cost=True)
    assert again[0] == {"prompt": "p0", "chosen": "b", "rejected": "a", "chosen_safe": True, "rejected_safe": False}


def test_hh_rlhf_dialogues_share_their_prefix_as_the_prompt(tiny_model, tmp_path):
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    dialogue = "\n\nHuman: What is 12+35?\n\nAssistant:"
    row = {"prompt": None, "chosen": dialogue + " 47", "rejected": dialogue + " 46, I think"}
    prompt, chosen, rejected = pair_tokens(row, tokenizer, chat=False)
    assert prompt + chosen[:-1] == tokenizer(row["chosen"])["input_ids"]
    assert prompt + rejected[:-1] == tokenizer(row["rejected"])["input_ids"]
    assert chosen[-1] == rejected[-1] == tokenizer.eos_token_id and chosen[0] != rejected[0]
    # the held-out split of a file without val files is the same every time, and disjoint
    rows = [{"chosen": f"{dialogue} {i}", "rejected": f"{dialogue} no"} for i in range(40)]
    cfg = PairDataConfig(train_files=[write_jsonl(tmp_path / "hh.jsonl", rows)], prompt_key="", val_fraction=0.25)
    train, val = read_pair_rows(cfg, "train"), read_pair_rows(cfg, "val")
    assert len(val) == 10 and len(train) == 30 and val == read_pair_rows(cfg, "val")
    assert not {r["chosen"] for r in train} & {r["chosen"] for r in val}
    assert len(tokenize_pairs(val, tokenizer, cfg)) == 10


def test_data_errors_name_the_flag(tmp_path):
    files = [write_jsonl(tmp_path / "x.jsonl", [{"prompt": "p", "good": "a", "bad": "b", "which": 2}] * 4)]
    with pytest.raises(DataError, match="--data.chosen-key"):
        read_pair_rows(PairDataConfig(train_files=files, val_files=files), "train")
    with pytest.raises(DataError, match="--data.preferred-key"):
        read_pair_rows(PairDataConfig(train_files=files, val_files=files, chosen_key="good", rejected_key="bad",
                                      preferred_key="which"), "train")
    with pytest.raises(DataError, match="--data.chosen-safe-key"):
        read_pair_rows(PairDataConfig(train_files=files, val_files=files, chosen_key="good", rejected_key="bad"),
                       "train", cost=True)


def test_reward_flags_are_checked_before_any_work(tiny_model, tmp_path):
    assert reward_roles(RewardConfig()) == [] and reward_roles(RewardConfig(model="default")) == ["reward"]
    embedded = object()   # any embedded default: only its presence matters here
    assert scorer_flag_problems("", "--reward.model", "reward", ModelConfig(), embedded) == []
    assert scorer_flag_problems("default", "--reward.model", "reward", ModelConfig(), embedded) == []
    assert scorer_flag_problems(str(tiny_model), "--reward.model", "reward", ModelConfig(), embedded) == []
    [given] = scorer_flag_problems("default", "--reward.model", "reward", ModelConfig(path=str(tiny_model)), embedded)
    assert given.startswith("--reward.model default is the embedded default policy's reward model")
    [missing] = scorer_flag_problems(str(tmp_path / "nope"), "--cost.model", "cost", ModelConfig(), embedded)
    assert missing.startswith("--cost.model") and "no config.json" in missing
    # a reward model trained with another tokenizer would read the policy's ids as other tokens
    from transformers import AutoTokenizer, PreTrainedTokenizerFast
    from tokenizers import Tokenizer, models, pre_tokenizers
    other = Tokenizer(models.WordLevel({"a": 0, "b": 1, "<unk>": 2}, unk_token="<unk>"))
    other.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=other).save_pretrained(tmp_path / "other")
    policy_tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    check_same_tokenizer(tiny_model, policy_tokenizer)
    with pytest.raises(ValueError, match="tokenizer is not the policy's"):
        check_same_tokenizer(tmp_path / "other", policy_tokenizer)


# ---------------------------------------------------------------- workers and recipes

@pytest.mark.dist
def test_trained_reward_model_matches_transformers(tmp_path):
    """2 ranks, one pair per micro-batch, pairs of uneven lengths: scores = transformers' pooled
    output, the reported loss = Bradley-Terry by hand, the export loads with the trained weights."""
    path = tiny_model_dir(tmp_path / "model")
    run = torchrun(os.path.join(PROGRAMS, "reward_model_train.py"), nproc=2, args=[path, tmp_path],
                   tmp_path=tmp_path, timeout=300, env={**TESTS_ENV, "HFLOW_DEVICE": "cpu"}).check()
    assert "reward model ok" in run.output


def metrics_rows(out):
    return [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.dist
@pytest.mark.parametrize("cost", [False, True])
def test_reward_model_recipe_trains_reports_and_exports(tiny_model, tmp_path, cost):
    rows = [{"prompt": f"{a}+{a}=", "chosen": str(2 * a), "rejected": "x", "chosen_safe": True,
             "rejected_safe": a % 2 == 0} for a in range(10, 50)]
    data = write_jsonl(tmp_path / "pairs.jsonl", rows)
    out = tmp_path / "rm"
    args = ["--model.path", tiny_model, "--data.train-files", data, "--data.batch-size", 8, "--steps", 3,
            "--eval-every", 2, "--output-dir", out, "--logging.no-progress-bars", "--data.val-fraction", 0.2]
    torchrun(str(RECIPES / "reward_model.py"), 2, args + (["--cost"] if cost else []), timeout=300).check()
    logged = metrics_rows(out)
    assert [r["step"] for r in logged] == [0, 1, 2, 3]
    for step in (0, 2, 3):
        assert 0 <= logged[step]["eval/pair_accuracy"] <= 1 and "eval/pair_margin" in logged[step]
        assert ("eval/sign_accuracy" in logged[step]) == cost
    assert "rm/loss" in logged[1] and "rm/accuracy" in logged[1]
    from transformers import AutoModelForSequenceClassification
    exported = AutoModelForSequenceClassification.from_pretrained(out / "model")
    assert exported.config.num_labels == 1


@pytest.fixture(scope="module")
def tiny_reward_model(tiny_model, tmp_path_factory):
    """A random sequence classifier on the tiny default's config and tokenizer."""
    from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer
    config = AutoConfig.from_pretrained(tiny_model)
    config.num_labels, config.architectures = 1, None
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("tiny_rm") / "rm"
    AutoModelForSequenceClassification.from_config(config).save_pretrained(path)
    AutoTokenizer.from_pretrained(tiny_model).save_pretrained(path)
    return path


@pytest.mark.dist
@pytest.mark.parametrize("placement", ["colocate", "split"])
def test_ppo_with_a_reward_model_in_the_loop(tiny_model, tiny_reward_model, tmp_path, placement):
    """Colocated: the training score is the reward model's alone. Split (2 ranks: actor on one,
    critic and reward model on the other): rule + 0.5 * rm."""
    out = tmp_path / placement
    extra = ["--reward.fn", "arithmetic", "--reward.model-weight", 0.5] if placement == "split" else []
    args = ["--model.path", tiny_model, "--trainer.output-dir", out, "--trainer.steps", 2, "--data.batch-size", 4,
            "--rollout.n", 2, "--rollout.max-tokens", 4, "--trainer.eval-size", 8, "--trainer.no-export",
            "--trainer.logging.no-progress-bars", "--algo.critic-warmup", 0, "--trainer.placement", placement,
            "--reward.model", tiny_reward_model, *extra]
    torchrun(str(RECIPES / "ppo.py"), 2, args, timeout=400).check()
    logged = metrics_rows(out)
    assert [r["step"] for r in logged] == [0, 1, 2]
    for row in logged[1:]:
        rm, rule = row["reward/rm_mean"], row["reward/rule_mean"]
        expected = rule + 0.5 * rm if placement == "split" else rm
        assert row["reward/mean"] == pytest.approx(expected, rel=1e-5, abs=1e-6)
        assert row["reward/rm_std"] > 0 and "actor/loss" in row and "critic/loss" in row
    assert "eval/reward_mean" in logged[-1]
