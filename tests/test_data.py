"""hflow.data: file loaders, chat prompts, the length filter, flag-naming errors, the built-in
task, and the resumable sampler. A tiny byte-level BPE tokenizer is built and reloaded as a user's
would be; the oracle for token ids is that tokenizer called directly."""
import json
import logging

import pytest

from hflow.data import (DataConfig, DataError, PromptDataset, PromptSampler, build_prompts,
                        iter_batches, load_prompts, task_splits)

CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                 "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["12+35=47", "what is 2+2?", "user assistant system", "hello world"] * 20, trainer)
    path = tmp_path_factory.mktemp("tokenizer")
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>",
                            chat_template=CHAT_TEMPLATE).save_pretrained(path)
    return AutoTokenizer.from_pretrained(path)


ROWS = [{"question": f"what is {a}+{b}?", "answer": str(a + b), "level": a % 3} for a, b in
        [(1, 2), (3, 4), (10, 20), (7, 8), (11, 12), (5, 5)]]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def write_parquet(path, rows):
    import pyarrow as pa
    import pyarrow.parquet as pq
    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


def ids_of(tokenizer, text, special=True):
    return tokenizer(text, add_special_tokens=special)["input_ids"]


# ---------------------------------------------------------------- loading

@pytest.mark.parametrize("fmt", ["jsonl", "parquet", "datasets_dir"])
def test_loads_every_format_with_ids_text_answer_and_extra_columns(tmp_path, tokenizer, fmt):
    if fmt == "jsonl":
        path = write_jsonl(tmp_path / "train.jsonl", ROWS)
    elif fmt == "parquet":
        path = write_parquet(tmp_path / "train.parquet", ROWS)
    else:
        import datasets
        path = str(tmp_path / "saved")
        datasets.Dataset.from_list(ROWS).save_to_disk(path)
    cfg = DataConfig(train_files=[path], prompt_key="question", answer_key="answer")
    ds = load_prompts(cfg, tokenizer)
    assert len(ds) == len(ROWS) and ds.num_dropped == 0
    for i, row in enumerate(ROWS):
        p = ds[i]
        assert p.prompt == row["question"]
        assert p.prompt_ids == ids_of(tokenizer, row["question"])
        assert p.ground_truth == row["answer"] and p.extra == {"level": row["level"]} and p.index == i
    assert load_prompts(cfg, tokenizer, "val") is None  # no --data.val-files


def test_datasets_dict_dir_picks_the_split_of_its_role(tmp_path, tokenizer):
    import datasets
    path = str(tmp_path / "dd")
    datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS[:4]),
                          "test": datasets.Dataset.from_list(ROWS[4:])}).save_to_disk(path)
    cfg = DataConfig(train_files=[path], val_files=[path], prompt_key="question")
    assert [p.ground_truth for p in iter_batches(load_prompts(cfg, tokenizer), 10).__next__()] == ["3", "7", "30", "15"]
    assert len(load_prompts(cfg, tokenizer, "val")) == 2


def test_several_files_concatenate_and_nested_answer_key(tmp_path, tokenizer):
    rows = [{"prompt": r["question"], "reward_model": {"ground_truth": r["answer"]}} for r in ROWS]
    a = write_parquet(tmp_path / "a.parquet", rows[:2])
    b = write_jsonl(tmp_path / "b.jsonl", rows[2:])
    ds = load_prompts(DataConfig(train_files=[a, b], answer_key="reward_model.ground_truth"), tokenizer)
    assert ds.ground_truths == [r["answer"] for r in ROWS]


def test_chat_prompts_use_the_template_with_generation_prompt(tmp_path, tokenizer):
    rows = [{"prompt": [{"role": "system", "content": "be brief"}, {"role": "user", "content": r["question"]}],
             "answer": r["answer"]} for r in ROWS[:3]]
    ds = load_prompts(DataConfig(train_files=[write_jsonl(tmp_path / "chat.jsonl", rows)]), tokenizer)
    expected = (f"<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\n{ROWS[0]['question']}<|im_end|>\n"
                "<|im_start|>assistant\n")
    assert ds[0].prompt == expected
    assert ds[0].prompt_ids == ids_of(tokenizer, expected, special=False)
    special = set(tokenizer.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"]))
    assert special <= set(ds[0].prompt_ids)  # the template's markers are single special tokens
    # --data.chat wraps string prompts as one user message
    plain = write_jsonl(tmp_path / "plain.jsonl", ROWS[:1])
    ds = load_prompts(DataConfig(train_files=[plain], prompt_key="question", chat=True), tokenizer)
    assert ds[0].prompt == f"<|im_start|>user\n{ROWS[0]['question']}<|im_end|>\n<|im_start|>assistant\n"


def test_system_prompt_goes_first_unless_the_messages_have_one(tmp_path, tokenizer):
    plain = write_jsonl(tmp_path / "plain.jsonl", ROWS[:1])
    ds = load_prompts(DataConfig(train_files=[plain], prompt_key="question", chat=True,
                                 system_prompt="use <calc>"), tokenizer)
    assert ds[0].prompt == (f"<|im_start|>system\nuse <calc><|im_end|>\n<|im_start|>user\n{ROWS[0]['question']}"
                            "<|im_end|>\n<|im_start|>assistant\n")
    # the messages the ids encode travel with them (a multi-turn rollout renders them, not the text)
    assert ds[0].messages == [{"role": "system", "content": "use <calc>"}, {"role": "user", "content": ROWS[0]["question"]}]
    # a row's own system message is the row's: the flag does not replace it
    own = write_jsonl(tmp_path / "own.jsonl", [{"prompt": [{"role": "system", "content": "be brief"},
                                                           {"role": "user", "content": "hi"}], "answer": "1"}])
    ds = load_prompts(DataConfig(train_files=[own], system_prompt="use <calc>"), tokenizer)
    assert ds[0].prompt.startswith("<|im_start|>system\nbe brief<|im_end|>") and "calc" not in ds[0].prompt
    # plain text has no system message to hold it: an error that names the flag to add
    with pytest.raises(DataError, match="--data.system-prompt.*--data.chat"):
        load_prompts(DataConfig(train_files=[plain], prompt_key="question", system_prompt="x"), tokenizer)
    assert load_prompts(DataConfig(train_files=[plain], prompt_key="question"), tokenizer)[0].messages is None

def test_long_prompts_are_dropped_counted_and_reported(tmp_path, tokenizer, caplog):
    lengths = [len(ids_of(tokenizer, r["question"])) for r in ROWS]
    limit = sorted(lengths)[len(lengths) // 2]
    expected_kept = [r["answer"] for r, n in zip(ROWS, lengths) if n <= limit]
    assert 0 < len(expected_kept) < len(ROWS)
    cfg = DataConfig(train_files=[write_jsonl(tmp_path / "t.jsonl", ROWS)], prompt_key="question",
                     max_prompt_length=limit)
    with caplog.at_level(logging.WARNING, logger="hflow.data"):
        ds = load_prompts(cfg, tokenizer)
    assert ds.ground_truths == expected_kept
    assert ds.num_dropped == len(ROWS) - len(expected_kept)
    assert all(len(p) <= limit for p in ds.prompt_ids)
    assert f"dropped {ds.num_dropped} of {len(ROWS)}" in caplog.text and "--data.max-prompt-length" in caplog.text
    with pytest.raises(DataError, match="--data.max-prompt-length"):
        load_prompts(DataConfig(train_files=cfg.train_files, prompt_key="question", max_prompt_length=1), tokenizer)


def test_errors_name_the_flag_to_fix(tmp_path, tokenizer):
    good = write_jsonl(tmp_path / "good.jsonl", ROWS)

    def error(**kw):
        kw.setdefault("prompt_key", "question")
        with pytest.raises(DataError) as e:
            cfg = DataConfig(**kw)
            load_prompts(cfg, tokenizer, "val" if kw.get("val_files") else "train")
        return str(e.value)

    assert "--data.train-files" in error(train_files=[str(tmp_path / "missing.jsonl")])
    assert "--data.val-files" in error(train_files=[good], val_files=[str(tmp_path / "nope.parquet")])
    (tmp_path / "empty.jsonl").write_text("")
    assert "--data.train-files" in error(train_files=[str(tmp_path / "empty.jsonl")])
    empty_parquet = write_parquet(tmp_path / "empty.parquet", [])
    assert "--data.train-files" in error(train_files=[empty_parquet])
    (tmp_path / "notes.txt").write_text("hi")
    assert "--data.train-files" in error(train_files=[str(tmp_path / "notes.txt")])
    msg = error(train_files=[good], prompt_key="prompt")
    assert "--data.prompt-key" in msg and "question" in msg  # lists the columns there are
    assert "--data.answer-key" in error(train_files=[good], answer_key="solution")
    partly = write_jsonl(tmp_path / "partly.jsonl", [{"question": "q", "answer": "1"}, {"question": "q"}])
    assert "--data.answer-key" in error(train_files=[partly])
    assert "--data.prompt-key" in error(train_files=[write_jsonl(tmp_path / "n.jsonl", [{"question": 5, "answer": "1"}])])
    assert "--data.task" in error(task="sudoku")
    # a broken line is named as an editor counts (line 1 first), not as a parser's row from 0
    (tmp_path / "broken.jsonl").write_text('{"question": "q", "answer": "1"}\n\n{"question": "q" "answer": "2"}\n')
    assert error(train_files=[str(tmp_path / "broken.jsonl")]) == (
        f"--data.train-files: cannot read {tmp_path / 'broken.jsonl'}: line 3 is not JSON: "
        f"Expecting ',' delimiter at column 18")
    (tmp_path / "latin1.jsonl").write_bytes('{"question": "q", "answer": "1"}\n{"question": "caf\u00e9", "answer": "2"}\n'
                                            .encode("latin-1"))
    assert error(train_files=[str(tmp_path / "latin1.jsonl")]) == (
        f"--data.train-files: cannot read {tmp_path / 'latin1.jsonl'}: line 2 is not UTF-8 (byte 0xe9 at "
        f"column 18); save the file as UTF-8")
    assert "row 2 of" in error(train_files=[partly])   # rows count from 1 too
    from hflow.validation import UserError
    assert issubclass(DataError, UserError)   # the run ends with the message alone, no traceback


def test_a_nan_answer_is_a_data_error_naming_the_file_row_and_column(tmp_path, tokenizer):
    # a hole in an int column: pandas writes NaN (json.dumps too), and Arrow reads the column as
    # floats, so the NaN would reach the scorer as a ground truth and the 12 as 12.0
    rows = [{"question": "q1", "answer": 12}, {"question": "q2", "answer": float("nan")}]
    jsonl, parquet = write_jsonl(tmp_path / "holes.jsonl", rows), write_parquet(tmp_path / "holes.parquet", rows)
    nested = write_jsonl(tmp_path / "nested.jsonl", [{"question": "q", "reward_model": {"ground_truth": 12}},
                                                     {"question": "q", "reward_model": {"ground_truth": float("nan")}}])
    for path, key in ((jsonl, "answer"), (parquet, "answer"), (nested, "reward_model.ground_truth")):
        with pytest.raises(DataError) as e:
            load_prompts(DataConfig(train_files=[path], prompt_key="question", answer_key=key), tokenizer)
        assert str(e.value) == (f"--data.answer-key: row 2 of {path!r} has NaN in its {key!r} value "
                                "(a missing answer?): fill it in or drop the row")
    # a countdown-style answer holds its NaN inside
    inside = write_jsonl(tmp_path / "inside.jsonl", [{"question": "q", "answer": {"target": float("nan"), "numbers": [1]}}])
    with pytest.raises(DataError, match="row 1 of .* has NaN in its 'answer' value"):
        load_prompts(DataConfig(train_files=[inside], prompt_key="question"), tokenizer)
    # without the hole, ints stay ints
    whole = write_jsonl(tmp_path / "whole.jsonl", rows[:1] + [{"question": "q2", "answer": 7}])
    answers = load_prompts(DataConfig(train_files=[whole], prompt_key="question"), tokenizer).ground_truths
    assert answers == [12, 7] and all(type(a) is int for a in answers)


def test_prompts_without_answers(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "hello world"}])
    ds = load_prompts(DataConfig(train_files=[path], answer_key=""), tokenizer)
    assert ds[0].ground_truth is None and ds[0].prompt == "hello world"


# ---------------------------------------------------------------- built-in task

def test_builtin_task_is_deterministic_disjoint_and_correct(tokenizer):
    train, held_out = task_splits("arithmetic", seed=0, eval_size=500)
    assert len(held_out) == 500 and len(train) == 90 * 90 + 90 * 91 // 2 - 500
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in held_out}
    assert len({r["prompt"] for r in train}) == len(train)
    assert (train, held_out) == task_splits("arithmetic", seed=0, eval_size=500)
    assert task_splits("arithmetic", seed=1, eval_size=500)[1] != held_out
    for row in train[:200] + held_out:
        a, op, b = row["prompt"][:2], row["prompt"][2], row["prompt"][3:5]
        assert row["prompt"].endswith("=") and len(row["prompt"]) == 6
        assert int(row["answer"]) == (int(a) + int(b) if op == "+" else int(a) - int(b)) >= 0
    # exposed like a file dataset; the default reward scores its ground truth right
    from hflow.rewards import get_reward_fn
    cfg = DataConfig()
    train_ds, val_ds = load_prompts(cfg, tokenizer, "train"), load_prompts(cfg, tokenizer, "val")
    assert len(val_ds) == cfg.task_eval_size and len(train_ds) == len(train)
    assert val_ds[0].prompt == held_out[0]["prompt"] and val_ds[0].prompt_ids == ids_of(tokenizer, held_out[0]["prompt"])
    score = get_reward_fn("arithmetic")
    assert score(val_ds[0].ground_truth + "\n", val_ds[0].ground_truth) == 1.0


# ---------------------------------------------------------------- sampler

def toy_dataset(n):
    return PromptDataset([[i] for i in range(n)], [str(i) for i in range(n)], list(range(n)), [{}] * n, "toy")


def ids(batch):
    return [p.index for p in batch]


def test_sampler_epochs_are_permutations_and_drop_last():
    sampler = PromptSampler(toy_dataset(10), batch_size=3, seed=7)
    assert len(sampler) == 3
    epochs = [[i for _ in range(3) for i in ids(next(sampler))] for _ in range(3)]
    for e, seen in enumerate(epochs):
        assert len(seen) == 9 and len(set(seen)) == 9  # 10 // 3 batches of exactly 3, no repeats
        assert seen == list(sampler.order(e)[:9])
    assert epochs[0] != epochs[1]  # reshuffled each epoch
    assert ids(next(PromptSampler(toy_dataset(10), 3, seed=7))) == epochs[0][:3]  # same seed, same order
    assert list(PromptSampler(toy_dataset(10), 3, seed=8).order(0)) != list(sampler.order(0))
    ordered = PromptSampler(toy_dataset(10), 5, shuffle=False)
    assert [ids(next(ordered)) for _ in range(3)] == [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9], [0, 1, 2, 3, 4]]
    assert [len(b) for b in iter_batches(toy_dataset(10), 4)] == [4, 4, 2]
    with pytest.raises(ValueError, match="--data.batch-size"):
        PromptSampler(toy_dataset(2), batch_size=3)


def test_sampler_resume_equals_uninterrupted_run():
    uninterrupted = PromptSampler(toy_dataset(11), batch_size=4, seed=3)
    expected = [ids(next(uninterrupted)) for _ in range(10)]  # crosses several epochs
    for stop in (0, 1, 2, 3, 7):
        first = PromptSampler(toy_dataset(11), batch_size=4, seed=3)
        got = [ids(next(first)) for _ in range(stop)]
        state = json.loads(json.dumps(first.state_dict()))  # survives a JSON checkpoint
        resumed = PromptSampler(toy_dataset(11), batch_size=4, seed=3)
        resumed.load_state_dict(state)
        got += [ids(next(resumed)) for _ in range(10 - stop)]
        assert got == expected, stop
    with pytest.raises(ValueError, match="seed"):
        PromptSampler(toy_dataset(11), batch_size=4, seed=4).load_state_dict(state)
    with pytest.raises(ValueError, match="num_prompts"):
        PromptSampler(toy_dataset(12), batch_size=4, seed=3).load_state_dict(state)


def test_sampler_batches_carry_ids_text_answer_extra(tmp_path, tokenizer):
    ds = build_prompts([{"prompt": r["question"], "answer": r["answer"], "extra": {"level": r["level"]}} for r in ROWS],
                       tokenizer, max_prompt_length=64, source="rows")
    batch = next(PromptSampler(ds, batch_size=4, seed=0))
    assert len(batch) == 4
    for p in batch:
        row = ROWS[p.index]
        assert (p.prompt, p.ground_truth, p.extra) == (row["question"], row["answer"], {"level": row["level"]})
        assert p.prompt_ids == ids_of(tokenizer, row["question"])
