"""A generative judge as a reward (--reward.judge): the parse rule on hand-written verdicts, the
template, the flags checked before any work, the Judge role against transformers' own greedy
generate, GRPO with a judge on 2 ranks (a tiny random judge, whose unparsable verdicts are
counted; SmolLM2 as the judge, mixed with the rule), and SmolLM2 judging right and wrong answers."""
import json
import os
from pathlib import Path

import pytest
import torch

from dist import PROGRAMS, torchrun
from hflow.batch import Batch
from hflow.default.model import build_default
from hflow.recipe_kit.judging import JudgeReward, judge_flag_problems, judged_prompt_texts
from hflow.recipe_kit.scoring import reward_roles
from hflow.rewards import RewardConfig
from hflow.rewards.judge import default_template, load_template, parse_verdict, render, template_fields
from hflow.validation import ConfigError, problems

RECIPES = Path(__file__).resolve().parents[1] / "recipes"
PAIRS_PROGRAM = os.path.join(PROGRAMS, "judge_pairs.py")


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return build_default(tmp_path_factory.mktemp("tiny") / "model", "tiny", seed=0)


def metrics_rows(out) -> list[dict]:
    return [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]


# ---------------------------------------------------------------- the parse rule


@pytest.mark.parametrize("verdict, expected", [
    ("The answer is right. Score: 7", 0.7),
    ("score: 10", 1.0),
    ("SCORE=0", 0.0),
    ("**Score:** 8.5", 0.85),
    ("<score>3</score>", 0.3),
    ("<score> 6 </score> because ...", 0.6),
    ("Score: 2 at first, but on reflection Score: 9", 0.9),     # the last match wins
    ("Score: 9. No wait: <score>4</score>", 0.4),               # across both forms, the last
    ("Score: 7/10", 0.7),
    ("Score: 11", None),                                         # outside the range: unparsable
    ("Score: -1", None),
    ("Score: 8, then Score: 12", None),                          # the last is out of range: no fallback
    ("I would give it a 7.", None),                              # a number without the form
    ("", None),
    ("The scoreboard: 5", None),                                 # "score" must be a word of its own
])
def test_score_rule_reads_the_last_score_in_range_scaled_to_0_1(verdict, expected):
    got = parse_verdict(verdict, "score", (0, 10))
    assert got == (None if expected is None else pytest.approx(expected))


def test_score_rule_scales_by_the_range():
    assert parse_verdict("Score: 3", "score", (1, 5)) == pytest.approx(0.5)
    assert parse_verdict("Score: 0", "score", (1, 5)) is None
    assert parse_verdict("Score: 0.5", "score", (0, 1)) == pytest.approx(0.5)


@pytest.mark.parametrize("verdict, expected", [
    ("Yes", 1.0), ("no.", 0.0), ("Yes, the answer is right.", 1.0),
    ("No, the answer is not correct.", 0.0),
    ("Yes at first glance... no, it is wrong", 0.0),   # the last wins
    ("No doubt about it: YES", 1.0),
    ("Yesterday it was nothing", None),                # words of their own only
    ("The answer is correct.", None),
])
def test_yes_no_rule_reads_the_last_standalone_yes_or_no(verdict, expected):
    assert parse_verdict(verdict, "yes_no") == expected


def test_unknown_parse_rule_is_refused():
    with pytest.raises(ValueError, match="unknown judge parse rule"):
        parse_verdict("Score: 1", "stars")


# ---------------------------------------------------------------- the template


def test_default_template_names_what_the_rule_reads_and_the_reference_only_when_there_is_one():
    with_ref = default_template("score", (0, 10), with_reference=True)
    assert template_fields(with_ref) == ["prompt", "reference", "response"]
    text = render(with_ref, "What is 2+2?", "5", 4)
    assert "Question:\nWhat is 2+2?" in text and "Reference answer:\n4" in text and "Answer to grade:\n5" in text
    assert 'from 0 (wrong) to 10 (right) on the last line, written as "Score: N"' in text
    without = default_template("yes_no", (0, 10), with_reference=False)
    assert template_fields(without) == ["prompt", "response"] and "Reply Yes or No." in without
    assert default_template("score", (1, 5), True).count("from 1 (wrong) to 5 (right)") == 1


def test_a_template_file_is_rendered_with_its_fields_and_literal_braces(tmp_path):
    path = tmp_path / "t.txt"
    path.write_text('Q: {prompt}\nA: {response}\nGold: {reference}\nReply as JSON {{"score": N}}.')
    template = load_template(str(path))
    assert render(template, "1+1=", "2", None) == 'Q: 1+1=\nA: 2\nGold: \nReply as JSON {"score": N}.'


@pytest.mark.parametrize("text, message", [
    ("{prompt} {answer}", r"unknown field\(s\) \{answer\}"),
    ("{prompt}", r"has no \{response\}"),
    ("{response} {", "not a template"),
])
def test_a_bad_template_file_is_refused_with_the_fix(tmp_path, text, message):
    path = tmp_path / "t.txt"
    path.write_text(text)
    with pytest.raises(ConfigError, match=message):
        load_template(str(path))


def test_judge_flags_are_checked_before_any_work(tiny_model, tmp_path):
    assert judge_flag_problems(RewardConfig()) == []
    assert judge_flag_problems(RewardConfig(judge=str(tiny_model))) == []
    [auto] = judge_flag_problems(RewardConfig(judge=str(tiny_model)), "auto")
    assert auto.startswith("--trainer.placement auto does not plan a judge yet")
    [missing] = judge_flag_problems(RewardConfig(judge=str(tmp_path / "nothing")))
    assert missing.startswith(f"--reward.judge {tmp_path / 'nothing'}")
    good = tmp_path / "good.txt"
    good.write_text("{response}")
    [alone] = judge_flag_problems(RewardConfig(judge_template=str(good)))
    assert "given without --reward.judge" in alone
    [absent] = judge_flag_problems(RewardConfig(judge=str(tiny_model), judge_template=str(tmp_path / "none.txt")))
    assert absent == f"--reward.judge-template {tmp_path / 'none.txt'}: no such file"
    bad = tmp_path / "bad.txt"
    bad.write_text("{question}")
    [template] = judge_flag_problems(RewardConfig(judge=str(tiny_model), judge_template=str(bad)))
    assert "unknown field(s) {question}" in template
    found = problems(RewardConfig(judge_score_range=(5.0, 1.0), judge_max_tokens=0))
    assert sorted(found) == ["--judge-max-tokens 0: must be >= 1 (new tokens of a judge's verdict)",
                             "--judge-score-range (5.0, 1.0): must be two numbers, low < high"]


def test_the_judge_is_a_role_of_its_own():
    assert reward_roles(RewardConfig(judge="m")) == ["judge"]
    assert reward_roles(RewardConfig(model="default", judge="m")) == ["reward", "judge"]


def test_judge_metrics_count_the_unparsable_and_rate_over_the_slowest_rank():
    judge = JudgeReward.__new__(JudgeReward)   # the parse rule and the metrics, without a cluster
    judge.cfg = RewardConfig(judge="m", judge_parse="score")
    verdicts = ["Score: 10", "no idea", "Score: 5", "Score: 40"]
    scores, failures = judge.scored(verdicts)
    assert scores.tolist() == [1.0, 0.0, 0.5, 0.0]
    assert [f is None for f in failures] == [True, False, True, False] and "'no idea'" in failures[1]
    judged = Batch({"verdict": verdicts, "verdict_tokens": torch.tensor([3, 2, 3, 3]),
                    "prompt_tokens": torch.tensor([10, 20, 30, 40])}, meta={"judge_s": [1.0, 2.0]})
    metrics = JudgeReward.metrics(judged, scores, failures)
    assert metrics == {"reward/judge_mean": pytest.approx(0.375), "reward/judge_unparsable": 0.5,
                       "reward/judge_unparsable_count": 2.0, "reward/judge_verdicts_per_s": 2.0,
                       "reward/judge_tokens_per_s": 5.5, "reward/judge_prompt_tokens": 25.0}


def test_the_judge_reads_the_prompts_own_text_when_the_batch_has_it(tiny_model):
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    prompt, response = tokenizer("12+3=")["input_ids"], tokenizer("15")["input_ids"]
    ids = torch.tensor([prompt + response])
    batch = Batch({"input_ids": ids, "attention_mask": torch.ones_like(ids), "responses": torch.tensor([response])})
    assert judged_prompt_texts(batch, tokenizer) == [tokenizer.decode(prompt, skip_special_tokens=True)]
    assert judged_prompt_texts(batch | Batch({"prompt": ["twelve plus three"]}), tokenizer) == ["twelve plus three"]


# ---------------------------------------------------------------- the Judge role


def greedy_by_transformers(model_dir, prompts: list[str], max_tokens: int) -> list[str]:
    """The oracle: transformers' own greedy generate on the judge's chat-templated prompt."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    texts = []
    for prompt in prompts:
        text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                             add_generation_prompt=True)
        ids = torch.tensor([tokenizer(text, add_special_tokens=False)["input_ids"]])
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_tokens,
                                 pad_token_id=tokenizer.pad_token_id or 0)
        texts.append(tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True))
    return texts


@pytest.mark.dist
def test_judge_role_on_2_ranks_writes_transformers_greedy_verdicts(tiny_model, tmp_path):
    out = tmp_path / "judged.json"
    torchrun(PAIRS_PROGRAM, 2, [tiny_model, out, "--max-tokens", 12], timeout=300).check()
    result = json.loads(out.read_text())
    rows = result["rows"]
    assert result["ranks"] == 2 and len(rows) == 16
    template = default_template("score", (0, 10), with_reference=True)
    prompts = [render(template, r["question"], r["answer"], r["reference"]) for r in rows]
    assert [r["verdict"] for r in rows] == greedy_by_transformers(tiny_model, prompts, 12)
    # a random tiny model states no score: every verdict is unparsable
    assert all(r["score"] is None for r in rows)


@pytest.mark.dist
def test_a_judge_prompt_that_leaves_no_room_for_the_verdict_is_refused_with_the_flags(tiny_model, tmp_path):
    """The tiny model's context is 256 tokens: a 200-token prompt and a 64-token verdict do not fit."""
    script = f"""
        import hflow
        from hflow.workers.judge import Judge, JudgeConfig

        def main(cluster, cfg):
            judge = cluster.spawn(Judge, JudgeConfig(model_path={str(tiny_model)!r}, max_tokens=64))
            assert len(judge.verdicts(hflow.Batch({{"judge_prompt": ["1+1="]}}))) == 1
            print("SHORT PROMPT JUDGED", flush=True)
            judge.verdicts(hflow.Batch({{"judge_prompt": ["1+1=" * 50]}}))
            return "NOT REFUSED"

        print(hflow.launch(main))
    """
    run = torchrun(script, 1, tmp_path=tmp_path, timeout=300)   # a failed worker call fails the run
    assert run.returncode != 0 and "SHORT PROMPT JUDGED" in run.output and "NOT REFUSED" not in run.output
    assert "ValueError: a judge prompt of 209 tokens and a verdict of --reward.judge-max-tokens 64 do not fit " \
           "the judge's context of 256 tokens" in run.output


# ---------------------------------------------------------------- GRPO with a judge


def grpo_args(policy, out, *extra):
    return ["--model.path", policy, "--trainer.output-dir", out, "--trainer.steps", 2, "--data.batch-size", 4,
            "--rollout.n", 2, "--rollout.max-tokens", 4, "--trainer.eval-size", 8, "--trainer.no-export",
            "--trainer.logging.no-progress-bars", *extra]


@pytest.mark.dist
def test_grpo_with_a_tiny_random_judge_counts_its_unparsable_verdicts(tiny_model, tmp_path):
    """The judge alone scores (no --reward.fn): colocated with the actor on both ranks; a tiny
    random model's verdicts state no score, so each one is counted and scores 0."""
    out = tmp_path / "run"
    run = torchrun(str(RECIPES / "grpo.py"), 2, grpo_args(tiny_model, out, "--reward.judge", tiny_model,
                                                        "--reward.judge-max-tokens", 12), timeout=400).check()
    assert "placement: actor [0, 1], judge [0, 1]" in run.output
    logged = metrics_rows(out)
    assert [r["step"] for r in logged] == [0, 1, 2]
    for row in logged[1:]:
        rows = 4 * 2
        assert row["reward/judge_unparsable_count"] == rows * row["reward/judge_unparsable"]
        assert row["reward/judge_unparsable_count"] == rows and row["reward/judge_mean"] == 0.0
        assert row["reward/mean"] == row["reward/judge_mean"]    # the judge alone, weight 1
        assert row["reward/judge_verdicts_per_s"] > 0 and row["reward/judge_tokens_per_s"] > 0
        assert row["reward/judge_prompt_tokens"] > 20          # the built-in template around each row


@pytest.mark.dist
def test_grpo_with_smollm2_judging_on_a_rank_of_its_own_adds_its_weighted_score_to_the_rule(tiny_model, smollm2_dir,
                                                                                          tmp_path):
    """Split: the actor on rank 0, SmolLM2 as the judge on rank 1, with a template file that
    asks it to say Yes, parsed yes_no; the training score is rule + 0.5 * judge. (On the tiny
    policy's byte soup SmolLM2 says Yes to about half: judge_mean 0.5 in the run that set this.
    It must be above 0 for the sum to tell the weight apart.)"""
    template = tmp_path / "judge.txt"
    template.write_text("Reply with the single word Yes.\n\n{response}")
    out = tmp_path / "run"
    args = grpo_args(tiny_model, out, "--trainer.placement", "split", "--reward.fn", "arithmetic",
                     "--reward.judge", smollm2_dir, "--reward.judge-template", template,
                     "--reward.judge-parse", "yes_no", "--reward.judge-max-tokens", 4, "--reward.judge-weight", 0.5)
    run = torchrun(str(RECIPES / "grpo.py"), 2, args, timeout=600).check()
    assert "placement: actor [0], judge [1]" in run.output
    for row in metrics_rows(out)[1:]:
        assert row["reward/judge_mean"] > 0
        assert row["reward/mean"] == pytest.approx(row["reward/rule_mean"] + 0.5 * row["reward/judge_mean"])


# ---------------------------------------------------------------- a real judge


@pytest.mark.parametrize("parse", ["yes_no", "score"])
def test_smollm2_judges_right_and_wrong_answers(smollm2_dir, tmp_path, parse):
    """SmolLM2-135M-Instruct as the judge of 8 (question, right answer) and 8 (question, wrong
    answer) pairs with the built-in template, greedy, in one process. What a 135M model does
    (measured 2026-12-07): yes_no: every verdict parses, and every one is "No" (accuracy 0.5,
    the rate of a constant); score: no verdict states "Score: N" (it restates the answer).
    Asserted: the verdicts are transformers' own greedy ones, the parse counts, and for yes_no
    that they parse; the accuracy is printed, not asserted."""
    import subprocess
    import sys
    out = tmp_path / "judged.json"
    command = [sys.executable, PAIRS_PROGRAM, str(smollm2_dir), str(out), "--parse", parse, "--max-tokens", "16"]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0 and "JUDGE OK" in proc.stdout, proc.stdout + proc.stderr
    rows = json.loads(out.read_text())["rows"]
    template = default_template(parse, (0, 10), with_reference=True)
    first = [render(template, r["question"], r["answer"], r["reference"]) for r in rows[:4]]
    assert [r["verdict"] for r in rows[:4]] == greedy_by_transformers(smollm2_dir, first, 16)
    parsed = [r for r in rows if r["score"] is not None]
    right = sum((r["score"] >= 0.5) == r["right"] for r in parsed)
    print(f"SmolLM2 judge ({parse}): {len(parsed)} of {len(rows)} verdicts parse, {right} of them right")
    if parse == "yes_no":
        assert len(parsed) >= len(rows) * 3 // 4
