"""Real tasks as data: reasoning-gym datasets by name (``--data.task rg:NAME``) scored by their own
scorers (``--reward.fn reasoning_gym``), and GSM8K from the local copy. The oracles are
reasoning-gym itself (its generator, its ``score_answer``) and the files' own rows."""
import json
import re
import sys
from pathlib import Path

import pytest

from hflow.data import DataConfig, DataError, load_prompts, read_rows
from hflow.data.reasoning_gym import parse_task_args
from hflow.data.tasks import task_reward_fn, task_splits
from hflow.rewards import get_reward_fn, score_batch
from hflow.rewards.reasoning_gym import decode_metadata, encode_metadata, import_reasoning_gym
from hflow.validation import UserError

rg = pytest.importorskip("reasoning_gym", reason="the rg: tasks need reasoning-gym (pip install 'hflow[tasks]')")

GSM8K = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "gsm8k"
# chain_sum at its smallest: about 1,650 distinct problems in 3,000 draws, so repeats are many
SMALL_SUMS = ["min_terms=2", "max_terms=2", "min_digits=1", "max_digits=2"]
SMALL_SUMS_KWARGS = dict(min_terms=2, max_terms=2, min_digits=1, max_digits=2)


def questions(rows):
    return [r["extra"]["question"] for r in rows]


# ---------------------------------------------------------------- splits

def test_rg_splits_are_disjoint_and_fixed_by_the_seed():
    train, held_out = task_splits("rg:chain_sum", seed=0, eval_size=500, size=3000, args=SMALL_SUMS)
    drawn = rg.create_dataset("chain_sum", seed=0, size=3000, **SMALL_SUMS_KWARGS)
    questions_drawn = [drawn[i]["question"] for i in range(3000)]
    distinct = list(dict.fromkeys(questions_drawn))
    assert len(distinct) < 2000   # the generator does repeat itself at this size
    assert questions(held_out) == distinct[:500]   # the first distinct problems drawn
    assert not set(questions(train)) & set(questions(held_out))
    # training: every other draw, in draw order, repeats kept
    assert questions(train) == [q for q in questions_drawn if q not in set(distinct[:500])]
    assert len(set(questions(train))) == len(distinct) - 500 < len(train)
    again = task_splits("rg:chain_sum", seed=0, eval_size=500, size=3000, args=SMALL_SUMS)
    assert again == (train, held_out)
    other = task_splits("rg:chain_sum", seed=1, eval_size=500, size=3000, args=SMALL_SUMS)[1]
    assert questions(other) != questions(held_out)


def test_rg_splits_follow_the_tasks_own_distribution():
    """chain_sum's 2-term 1-2-digit sums are half 1-digit as drawn, but only 200 of ~1,650 distinct
    problems. The held-out split (the first distinct problems drawn) and training (every draw of
    another problem, repeats kept) both keep a large share of them (43 % and 31 % here), where
    training from the distinct problems after the held-out cut had 3 % (SmolLM2's greedy accuracy
    0.12 there against 0.25 held out), and a uniform cut over the distinct problems 12 % in both."""
    train, held_out = task_splits("rg:chain_sum", seed=0, eval_size=256, size=3000, args=SMALL_SUMS)

    def one_digit_share(rows):
        operands = [re.findall(r"\d+", r["extra"]["question"].split(":")[1]) for r in rows]
        return sum(all(len(x) == 1 for x in terms) for terms in operands) / len(rows)

    assert 0.3 < one_digit_share(held_out) < 0.55 and 0.25 < one_digit_share(train) < 0.55, \
        (one_digit_share(held_out), one_digit_share(train))


def test_rg_rows_are_chat_prompts_with_what_the_scorer_needs():
    train, _ = task_splits("rg:chain_sum", seed=0, eval_size=10, size=50, args=SMALL_SUMS)
    row = train[0]
    assert row["prompt"] == [{"role": "user", "content": row["extra"]["question"]}]
    metadata = decode_metadata(row["extra"]["metadata"])
    assert metadata["source_dataset"] == "chain_sum" and metadata["difficulty"]["num_terms"] == (2, 2)
    assert json.loads(row["extra"]["task_config"]) == {"dataset": "chain_sum", "args": SMALL_SUMS_KWARGS}
    assert task_reward_fn("rg:chain_sum") == "reasoning_gym" and task_reward_fn("arithmetic") == "arithmetic"


def test_too_few_distinct_problems_for_the_held_out_split_is_an_error():
    with pytest.raises(DataError, match="task-eval-size.*distinct problems"):
        task_splits("rg:chain_sum", seed=0, eval_size=60, size=60, args=SMALL_SUMS)


# ---------------------------------------------------------------- flags and errors

def test_task_args_are_json_literals_else_strings():
    assert parse_task_args(["min_terms=2", "p=0.5", "flag=true", "xs=[1, 2]", "op=add", "s=\"7\"", "e="]) == \
        {"min_terms": 2, "p": 0.5, "flag": True, "xs": [1, 2], "op": "add", "s": "7", "e": ""}
    for bad, said in [("min_terms", "KEY=VALUE"), ("=2", "KEY=VALUE"), ("seed=3", "--data.task-seed")]:
        with pytest.raises(DataError, match=said):
            parse_task_args([bad])
    with pytest.raises(DataError, match="twice"):
        parse_task_args(["a=1", "a=2"])


def test_unknown_names_and_arguments_are_errors_that_say_what_exists():
    with pytest.raises(DataError, match="no dataset 'chain_summ'; did you mean rg:chain_sum"):
        task_splits("rg:chain_summ", size=100, eval_size=10)
    with pytest.raises(DataError, match="min_terms, max_terms"):
        task_splits("rg:chain_sum", size=100, eval_size=10, args=["terms=2"])
    with pytest.raises(DataError, match="min_terms must be positive"):
        task_splits("rg:chain_sum", size=100, eval_size=10, args=["min_terms=0"])
    with pytest.raises(DataError, match="rg:NAME"):
        task_splits("sums", size=100, eval_size=10)
    with pytest.raises(DataError, match="task-args"):
        task_splits("arithmetic", args=["digits=3"])


def test_without_the_package_the_error_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "reasoning_gym", None)   # `import reasoning_gym` raises ImportError
    with pytest.raises(UserError, match="pip install reasoning-gym"):
        import_reasoning_gym()


# ---------------------------------------------------------------- the reward

@pytest.mark.parametrize("response, extracted", [
    ("<answer>6</answer>", "6"),
    ("The answer is 6.", "6"),
    ("1 + 5 = 6", "6"),
    ("I don't know", None),
    ("1 + 5 = 7", "7"),
    ("I think 7... <answer> 6 </answer>", "6"),
])
def test_reward_is_the_tasks_own_score_of_the_extracted_answer(response, extracted):
    entry = {"question": "State the final answer to the following arithmetic problem: 1 + 5 =", "answer": "6",
             "metadata": {"source_dataset": "chain_sum", "source_index": 2, "num_terms": 2, "num_digits": 1,
                          "expression": "1 + 5", "difficulty": {"num_terms": (2, 2), "num_digits": (1, 2)}}}
    own_score = rg.get_score_answer_fn("chain_sum")
    result = get_reward_fn("reasoning_gym")(response, entry["answer"], question=entry["question"],
                                            metadata=encode_metadata(entry["metadata"]))
    assert result == {"score": own_score(extracted, entry) if extracted else 0.0,
                      "answer_found": float(extracted is not None)}
    assert result["score"] == float(extracted == "6")
    if response == "The answer is 6.":   # why we extract: the whole prose gets partial credit
        assert own_score(response, entry) == pytest.approx(1 / 16)


def test_metadata_survives_json_with_tuples_and_non_string_keys():
    metadata = {"source_dataset": "graph_color", "colors": {0: 1, 1: 2}, "board": ((1, 2), (3, 4)),
                "edges": [[0, 1]], "pair": {(1, 2): "x"}, "__tuple__": "a real key"}
    assert decode_metadata(encode_metadata(metadata)) == metadata
    assert decode_metadata(metadata) is metadata


def test_rg_prompts_load_through_the_chat_template_and_score_after_a_file_round_trip(qwen3, tmp_path):
    cfg = DataConfig(task="rg:chain_sum", task_args=SMALL_SUMS, task_size=400, task_eval_size=50)
    train, held_out = load_prompts(cfg, qwen3, "train"), load_prompts(cfg, qwen3, "val")
    assert len(held_out) == 50 and not set(train.prompts) & set(held_out.prompts)
    question = held_out.extras[0]["question"]
    assert f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n" in held_out.prompts[0]
    fn = get_reward_fn(task_reward_fn(cfg.task))
    tagged = [f"<answer>{a}</answer>" for a in held_out.ground_truths]
    assert score_batch(fn, tagged, held_out.ground_truths, held_out.extras, inline=True).scores == [1.0] * 50
    # saved as a file and read back through datasets (Arrow), the rows score the same
    path = tmp_path / "held_out.jsonl"
    path.write_text("".join(json.dumps({"prompt": p, "answer": a, **e}) + "\n" for p, a, e in
                            zip(held_out.prompts, held_out.ground_truths, held_out.extras)))
    rows = read_rows([str(path)], "prompt", "answer", "--data.train-files")
    again = score_batch(fn, tagged, [r["answer"] for r in rows], [r["extra"] for r in rows], inline=True)
    assert again.scores == [1.0] * 50


# ---------------------------------------------------------------- GSM8K from the local copy

@pytest.mark.skipif(not GSM8K.is_dir(), reason=f"no local GSM8K copy at {GSM8K}")
def test_gsm8k_local_copy_loads_as_chat_prompts_and_its_references_score_1(qwen3):
    cfg = DataConfig(train_files=[str(GSM8K / "train.jsonl")], val_files=[str(GSM8K / "test.jsonl")],
                     prompt_key="question", chat=True, max_prompt_length=100_000)
    train, test = load_prompts(cfg, qwen3, "train"), load_prompts(cfg, qwen3, "val")
    assert (len(train), len(test)) == (7473, 1319) and train.num_dropped == test.num_dropped == 0
    first = json.loads((GSM8K / "test.jsonl").open().readline())
    assert test.prompts[0].startswith(f"<|im_start|>user\n{first['question']}<|im_end|>\n<|im_start|>assistant\n")
    assert test.ground_truths[0] == first["answer"] and test.extras[0] == {}
    gsm8k = get_reward_fn("gsm8k")
    for data in (train, test):
        finals = [solution.strip().splitlines()[-1] for solution in data.ground_truths]   # "#### 18"
        assert all(f.startswith("####") for f in finals)
        assert score_batch(gsm8k, finals, data.ground_truths, inline=True).scores == [1.0] * len(data)
    assert gsm8k("#### 17", test.ground_truths[0])["score"] == 0.0
