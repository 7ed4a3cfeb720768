"""Safe-RLHF: the embedded default's safety rule and its preference rows."""
import pytest

from hflow.data.safety import is_forbidden, is_refusal, is_safe, safety_preference_rows
from hflow.data.tasks import TASKS, task_splits


def test_forbidden_means_an_operand_in_the_70s():
    assert is_forbidden("71+12=") and is_forbidden("12+79=") and is_forbidden("77-70=")
    assert not is_forbidden("69+80=") and not is_forbidden("17+27=") and not is_forbidden("97-87=")
    assert is_forbidden("<|im_start|>user\n75+10=<|im_end|>")   # found inside a rendered prompt
    with pytest.raises(ValueError, match="not an arithmetic problem"):
        is_forbidden("hello")


def test_forbidden_share_of_the_task_counted_by_hand():
    # sums: 90*90 pairs, 80*80 with both operands outside 70-79; differences a >= b: 90*91/2,
    # 80*81/2 with both outside
    forbidden = sum(is_forbidden(p["prompt"]) for p in TASKS["arithmetic"].problems())
    assert forbidden == (90 * 90 - 80 * 80) + (90 * 91 // 2 - 80 * 81 // 2) == 2555


def test_safe_means_refusing_a_forbidden_problem_or_anything_on_an_allowed_one():
    assert is_refusal("") and is_refusal("no") and not is_refusal("83") and not is_refusal(" x3")
    assert not is_safe("71+12=", "83") and not is_safe("71+12=", "84")   # right or wrong: answered
    assert is_safe("71+12=", "") and is_safe("11+12=", "23") and is_safe("11+12=", "")


@pytest.mark.parametrize("split", ["train", "val"])
def test_preference_rows_put_the_safer_response_first_with_rule_labels(split):
    rows = safety_preference_rows(split, seed=0)
    train, held_out = task_splits("arithmetic", 0)
    problems = train if split == "train" else held_out
    forbidden = sum(is_forbidden(p["prompt"]) for p in problems)
    assert len(rows) == 2 * forbidden + (len(problems) - forbidden)   # two pairs per forbidden prompt
    assert {r["prompt"] for r in rows} == {p["prompt"] for p in problems}   # the split's own prompts
    for r in rows:
        assert r["chosen_safe"] == is_safe(r["prompt"], r["chosen"]) and r["chosen_safe"]
        assert r["rejected_safe"] == is_safe(r["prompt"], r["rejected"])
        assert r["rejected_safe"] != is_forbidden(r["prompt"])   # forbidden: the refusal beats an answer
    assert rows == safety_preference_rows(split, seed=0)   # deterministic
    allowed_first = [r["chosen"] == "" for r in rows if not is_forbidden(r["prompt"])]
    assert 0.4 < sum(allowed_first) / len(allowed_first) < 0.6   # equally safe: either order
