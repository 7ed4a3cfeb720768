"""hflow.rewards: every built-in scorer on right, wrong and malformed answers; the registry; the
worker pool's timeout, exception and crash handling (bounded in time)."""
import math
import multiprocessing
import os
import time

import pytest

from hflow.rewards import (RewardConfig, RewardPool, Scorer, get_reward_fn, register_reward_fn,
                           score_batch)
from hflow.rewards.arithmetic import arithmetic_score
from hflow.rewards.countdown import countdown_score, evaluate_equation
from hflow.rewards.gsm8k import gsm8k_flexible_score, gsm8k_score
from hflow.rewards.math_answer import is_equiv, last_boxed, math_score, normalize_answer


# ---------------------------------------------------------------- arithmetic

@pytest.mark.parametrize("response, truth, expected", [
    ("47", "47", 1.0), (" 47", "47", 1.0), ("47\n12+3=15", "47", 1.0), ("47.", "47", 1.0),
    ("47<|endoftext|>", 47, 1.0), ("0", "0", 1.0), ("-23", "-23", 1.0),
    ("470", "47", 0.0), ("4", "47", 0.0), ("46", "47", 0.0), ("-47", "47", 0.0), ("47.5", "47", 0.0),
    ("", "47", 0.0), ("forty-seven", "47", 0.0), ("the answer is 47", "47", 0.0), ("47", "n/a", 0.0),
])
def test_arithmetic(response, truth, expected):
    assert arithmetic_score(response, truth) == expected


# ---------------------------------------------------------------- gsm8k

SOLUTION = "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nShe sold 48+24 = <<48+24=72>>72 clips.\n#### 72"


@pytest.mark.parametrize("response, truth, strict, flexible", [
    ("She sold 48 + 24 = 72 clips.\n#### 72", "72", 1.0, 1.0),
    ("#### 72", SOLUTION, 1.0, 1.0),  # the ground truth may be the reference solution
    ("Total: $1,234.\n#### $1,234", "1234", 1.0, 1.0),
    ("#### 1,234.00", "1234", 1.0, 1.0),
    ("The loss is #### -5", "-5", 1.0, 1.0),
    ("First guess #### 70, no wait: #### 72", "72", 1.0, 1.0),  # the last #### counts
    ("She sold 72 clips.", "72", 0.0, 1.0),  # strict needs the #### format
    ("The answer is $1,080.", "1080", 0.0, 1.0),
    ("#### 71", "72", 0.0, 0.0),
    ("72 clips, so #### 7 2", "72", 0.0, 0.0),
    ("I don't know", "72", 0.0, 0.0),
    ("####", "72", 0.0, 0.0),
])
def test_gsm8k(response, truth, strict, flexible):
    assert gsm8k_score(response, truth)["score"] == strict
    assert gsm8k_flexible_score(response, truth)["score"] == flexible


def test_gsm8k_format_score_and_answer_found():
    assert gsm8k_score("#### 5", "6", format_score=0.1) == {"score": 0.1, "answer_found": 1.0}
    assert gsm8k_score("no answer", "6", format_score=0.1) == {"score": 0.0, "answer_found": 0.0}
    assert gsm8k_score("#### 6", "6", score=2.0)["score"] == 2.0
    t = time.perf_counter()
    gsm8k_flexible_score("1" * 20000 + "," * 20000 + "x", "1")  # linear-time regex
    assert time.perf_counter() - t < 1.0


# ---------------------------------------------------------------- math

def test_last_boxed_matches_nested_braces():
    assert last_boxed(r"so $\boxed{\frac{1}{\sqrt{2}}}$ hence $\boxed{\{1, 2\}}$.") == r"\{1, 2\}"
    assert last_boxed(r"x = \boxed{\frac{\sqrt{3}}{2}}") == r"\frac{\sqrt{3}}{2}"
    assert last_boxed(r"$\boxed 5$ dollars") == "5"
    assert last_boxed(r"\fbox{7}") == "7"
    assert last_boxed(r"cut off \boxed{\frac{1}{2") is None
    assert last_boxed("no box") is None


@pytest.mark.parametrize("prediction, truth", [
    (r"\frac{1}{2}", "0.5"), ("0.5", r"\frac{1}{2}"), (r"\dfrac{1}{2}", r"\frac12"), ("1/2", r"\tfrac{1}{2}"),
    (r"\frac{\sqrt{2}}{2}", r"\frac{1}{\sqrt{2}}"), (r"\frac{\sqrt{3}}{2}", r"\frac{\sqrt3}{2}"),
    (r"\left( 3, \frac{\pi}{2} \right)", r"(3,\frac{\pi}{2})"), (r"\left[1, 2\right)", "[1,2)"),
    (r"5\text{ cm}", "5"), ("12 apples", "12"), (r"10\%", "10"), (r"90^\circ", "90"), (r"\$1,000", "1000"),
    ("x = 3", "3"), ("3.00", "3"), ("2\\pi r", "2r\\pi"), ("x^2+2x+1", "(x+1)^2"), (r"2\cdot 3", "6"),
    (r"\sqrt[3]{8}", "2"), (r"\infty", r"\infty"), (r"\{1,2\}", r"\{1, 2\}"), (r"\text{(A)}", "(A)"),
])
def test_math_equivalent(prediction, truth):
    assert is_equiv(prediction, truth), (normalize_answer(prediction), normalize_answer(truth))


@pytest.mark.parametrize("prediction, truth", [
    ("0.333", r"\frac13"), ("3", "4"), (r"-\infty", r"\infty"), ("(1,2)", "[1,2]"), ("(1,2)", "(1,2,3)"),
    ("x+1", "x+2"), ("", "1"), (r"\frac{1}{0}", "1"), (r"\foo{1}", "1"),
])
def test_math_not_equivalent(prediction, truth):
    assert not is_equiv(prediction, truth)


def test_math_score_on_responses():
    ref = r"We get $x = \frac{1}{2}$, so the answer is $\boxed{\frac{1}{2}}$."  # MATH-style solution
    assert math_score(r"... so $\boxed{0.5}$", ref) == {"score": 1.0, "answer_found": 1.0}
    assert math_score(r"first \boxed{3}, finally \boxed{4}", "4")["score"] == 1.0
    assert math_score(r"first \boxed{4}, finally \boxed{3}", "4")["score"] == 0.0
    assert math_score("the answer is 4", "4") == {"score": 0.0, "answer_found": 0.0}
    assert math_score(r"\boxed{\frac{1}{2", "0.5")["score"] == 0.0  # cut off inside the box


def test_math_nan_equals_nothing_and_integral_floats_still_match():
    # NaN is not equal to itself: a NaN ground truth (a hole in the data) or a boxed "nan" scores 0
    assert math_score(r"\boxed{nan}", float("nan"))["score"] == 0.0
    assert math_score(r"\boxed{NaN}", "nan")["score"] == 0.0
    assert math_score(r"\boxed{12}", float("nan"))["score"] == 0.0
    assert not is_equiv("nan", "nan") and not is_equiv(r"\mathrm{NaN}", "NaN")
    # an int column read as floats (12.0) still matches a boxed 12, and the other way round
    assert math_score(r"\boxed{12}", 12.0)["score"] == 1.0
    assert math_score(r"\boxed{12.0}", 12)["score"] == 1.0


def test_math_rejects_hostile_and_huge_answers_fast(tmp_path):
    marker = tmp_path / "pwned"
    t = time.perf_counter()
    hostile = [rf"\boxed{{__import__('os').system('touch {marker}')}}", r"\boxed{9^{9^{9^{9}}}}",
               r"\boxed{2^{1000000}}", r"\boxed{(1).__class__}", r"\boxed{" + "{" * 500 + "1" + "}" * 500 + "}"]
    for response in hostile:
        assert math_score(response, "1")["score"] == 0.0
    assert not marker.exists() and time.perf_counter() - t < 5.0


# ---------------------------------------------------------------- countdown

NUMBERS = {"target": 80, "numbers": [25, 5, 4]}


@pytest.mark.parametrize("response, expected", [
    ("<think>25-5=20, 20*4=80</think> <answer>(25 - 5) * 4</answer>", 1.0),
    ("<answer>4*(25-5)</answer>", 1.0),
    ("<answer>25*4</answer> wait <answer>(25-5)*4</answer>", 1.0),  # the last tag counts
    ("<answer>(25 - 5) * 4 + 0</answer>", 0.1),  # a number that was not given
    ("<answer>25*4-5*4</answer>", 0.1),  # 4 used twice
    ("<answer>25 * 4</answer>", 0.1),  # 5 unused
    ("<answer>(25 - 5) * 4 = 80</answer>", 0.1),  # the target is not a number to use
    ("<answer>25 + 5 + 4</answer>", 0.1),  # wrong value
    ("<answer>(25 - 5 * 4</answer>", 0.1),  # does not parse
    ("<answer>25 ** 5 * 4</answer>", 0.1),  # powers are not allowed
    ("<answer>__import__('os')</answer>", 0.1),
    ("(25 - 5) * 4", 0.0),  # no answer tag
    ("<answer>(25-5)*4", 0.0),  # unclosed tag
])
def test_countdown(response, expected):
    assert countdown_score(response, NUMBERS)["score"] == expected


def test_countdown_exact_fractions_and_division_by_zero():
    assert countdown_score("<answer>1/3*3</answer>", {"target": 1, "nums": [1, 3, 3]})["score"] == 1.0
    assert countdown_score("<answer>6/0+3</answer>", {"target": 3, "numbers": [6, 0, 3]}) == \
        {"score": 0.1, "answer_found": 1.0, "numbers_ok": 1.0}
    assert countdown_score("<answer>(25-5)*4</answer>", 80, numbers=[25, 5, 4])["score"] == 1.0  # a numbers column
    assert evaluate_equation("-(3 - 10) / 2") == 3.5
    with pytest.raises(ValueError):
        evaluate_equation("1" + "+1" * 200)


# ---------------------------------------------------------------- registry

def right_when_equal(response, ground_truth, **extra):
    """A user's scorer: plus what the pool tests need (hanging, raising, dying, bad returns)."""
    if response == "hang":
        while True:
            time.sleep(1)
    if response == "raise":
        raise RuntimeError("scorer bug")
    if response == "die":
        os._exit(3)
    if response == "no score":
        return {"accuracy": 1.0}
    if response == "nan":
        return math.nan
    return {"score": float(response == ground_truth), "length": len(response) + extra.get("bonus", 0)}


def test_registry_by_name_and_module_function():
    assert get_reward_fn("gsm8k") is gsm8k_score and get_reward_fn("math") is math_score
    assert get_reward_fn("arithmetic") is arithmetic_score and get_reward_fn("countdown") is countdown_score
    assert get_reward_fn("test_rewards:right_when_equal") is right_when_equal
    assert get_reward_fn(right_when_equal) is right_when_equal
    register_reward_fn("mine", "test_rewards:right_when_equal")
    assert get_reward_fn("mine") is right_when_equal
    with pytest.raises(ValueError, match="--reward.fn"):
        get_reward_fn("gsm9k")
    with pytest.raises(ValueError, match="cannot import"):
        get_reward_fn("no_such_module_xyz:fn")
    with pytest.raises(ValueError, match="has no"):
        get_reward_fn("test_rewards:no_such_fn")


def test_config_flags_have_help(capsys):
    """tyro turns the field docstrings into flag help."""
    import tyro
    from hflow.data import DataConfig
    for cls, lines in ((RewardConfig, ("--timeout", "Seconds one response may take")),
                       (DataConfig, ("--max-prompt-length", "Prompts longer than", "--train-files"))):
        with pytest.raises(SystemExit):
            tyro.cli(cls, args=["--help"])
        helptext = " ".join(capsys.readouterr().out.split())  # undo tyro's line wrapping
        for line in lines:
            assert line in helptext, (line, helptext)


# ---------------------------------------------------------------- batch scoring

def test_builtins_score_inline_without_processes():
    children = set(multiprocessing.active_children())
    result = score_batch(get_reward_fn("gsm8k"), ["#### 1", "#### 2", "none"], ["1", "3", "1"])
    assert result.scores == [1.0, 0.0, 0.0] and result.failures == [None] * 3
    assert result.metrics["reward/answer_found"] == pytest.approx(2 / 3)
    assert set(multiprocessing.active_children()) == children


def test_inline_failures_are_caught_and_counted():
    result = score_batch(right_when_equal, ["a", "raise", "no score", "nan"], ["a"] * 4, inline=True)
    assert result.scores == [1.0, 0.0, 0.0, 0.0]
    assert result.metrics["reward/errors"] == 3.0
    assert "RuntimeError: scorer bug" in result.failures[1] and "'score'" in result.failures[2]


@pytest.mark.parametrize("value", ["1.0", "1e39", None, 1e39, 1e300, float("inf"), float("nan"), [1.0], {"score": "1"}])
def test_a_score_must_be_a_real_number_finite_in_float32(value):
    # "1.0" and "1e39" used to be accepted by float(); 1e300 became inf in float32 and ended the
    # run through NaN losses with reward/errors at 0
    result = score_batch(lambda response, truth: value, ["a"], ["a"], inline=True)
    assert result.scores == [0.0] and result.metrics["reward/errors"] == 1.0
    assert "not a number" in result.failures[0] or "not a finite float32" in result.failures[0]


@pytest.mark.parametrize("value, score", [(True, 1.0), (False, 0.0), (2, 2.0), (-0.5, -0.5), (3.4e38, 3.4e38)])
def test_real_numbers_are_scores(value, score):
    import numpy as np
    for given in (value, np.float64(value)):
        result = score_batch(lambda response, truth: given, ["a"], ["a"], inline=True)
        assert result.scores == [score] and result.failures == [None]


@pytest.mark.timeout(120)  # a pool that hangs must fail here, not stall the suite
def test_pool_survives_hanging_raising_and_dying_scorers(caplog):
    responses = ["a", "hang", "raise", "b", "die", "a", "hang", "c"]
    truths = ["a", "x", "x", "b", "x", "z", "x", "c"]
    extras = [{"bonus": 10}] + [{}] * 7
    earlier = set(multiprocessing.active_children())  # e.g. the shared pool of an earlier test
    with RewardPool(num_workers=2) as pool:
        t = time.monotonic()
        result = pool.score(right_when_equal, responses, truths, extras, timeout=1.0)
        elapsed = time.monotonic() - t
        assert result.scores == [1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 1.0]
        assert result.failures[1] == "timeout after 1s" and result.failures[6] == "timeout after 1s"
        assert result.failures[2] == "RuntimeError: scorer bug" and "exit code 3" in result.failures[4]
        assert (result.metrics["reward/timeouts"], result.metrics["reward/errors"],
                result.metrics["reward/crashes"]) == (2.0, 1.0, 1.0)
        assert result.details[0] == {"length": 11} and result.metrics["reward/length"] == pytest.approx(14 / 4)
        assert elapsed < 20, elapsed  # two 1 s timeouts on 2 workers, plus process starts on a busy machine
        assert "4 of 8 responses scored 0" in caplog.text
        # the killed workers were replaced: the pool goes on scoring
        again = pool.score(right_when_equal, ["a"] * 20, ["a"] * 20, timeout=5.0)
        assert again.scores == [1.0] * 20 and again.metrics["reward/errors"] == 0.0
    assert all(c.name != "hflow-reward-worker" for c in set(multiprocessing.active_children()) - earlier)


@pytest.mark.timeout(120)  # a pool that hangs must fail here, not stall the suite
def test_pool_runs_the_math_scorer_and_rejects_lambdas():
    scorer = Scorer(RewardConfig(fn="math", num_workers=1, timeout=30.0))
    try:
        result = scorer([r"\boxed{0.5}", r"\boxed{\frac{2}{3}}", "no box"], ["1/2", r"\frac{2}{3}", "1"])
        assert result.scores == [1.0, 1.0, 0.0] and result.metrics["reward/answer_found"] == pytest.approx(2 / 3)
    finally:
        scorer.close()
    with pytest.raises(TypeError, match="module level"):
        score_batch(lambda r, g: 1.0, ["a"], ["a"], pool=RewardPool(1))
    with pytest.raises(ValueError, match="ground truths"):
        score_batch(arithmetic_score, ["1", "2"], ["1"])


@pytest.mark.timeout(120)  # a pool that hangs must fail here, not stall the suite
def test_pool_loads_slow_modules_outside_the_item_timeout_and_reports_unloadable_ones(tmp_path, monkeypatch):
    import sys
    import types
    (tmp_path / "slow_scorer.py").write_text(
        "import time\ntime.sleep(1.5)  # an import as slow as torch's\n"
        "def score(response, ground_truth, **extra):\n    return float(response == ground_truth)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    ghost = types.ModuleType("ghost_scorer")  # importable here, not in a fresh process

    def ghost_score(response, ground_truth, **extra):
        return 1.0
    ghost_score.__module__, ghost_score.__qualname__ = "ghost_scorer", "ghost_score"
    ghost.ghost_score = ghost_score
    monkeypatch.setitem(sys.modules, "ghost_scorer", ghost)
    with RewardPool(num_workers=2, start_method="spawn") as pool:  # spawn: children see this sys.path
        t = time.monotonic()
        result = pool.score(get_reward_fn("slow_scorer:score"), ["1", "2", "3"], ["1", "2", "0"], timeout=0.5)
        assert result.scores == [1.0, 1.0, 0.0] and result.failures == [None] * 3
        result = pool.score(ghost_score, ["1", "2"], ["1", "2"], timeout=0.5)
        assert result.scores == [0.0, 0.0] and result.metrics["reward/errors"] == 2.0
        assert "cannot load the score function" in result.failures[0]
        assert time.monotonic() - t < 60


@pytest.mark.timeout(120)  # a pool that hangs must fail here, not stall the suite
def test_a_started_pool_has_loaded_the_function_before_the_first_batch(tmp_path, monkeypatch, capsys):
    """Workers start and import the scorer's module before any batch (issue 27.6): the first
    batch then scores within a timeout shorter than the import; an unloadable one is dropped."""
    (tmp_path / "slow_import_scorer.py").write_text(
        "import time\ntime.sleep(1.5)  # an import as slow as torch's\n"
        "def score(response, ground_truth, **extra):\n    return float(response == ground_truth)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    fn = get_reward_fn("slow_import_scorer:score")
    with RewardPool(num_workers=2, start_method="spawn") as pool:
        assert pool.start(fn) == 2
        t = time.monotonic()
        result = pool.score(fn, ["1", "2"], ["1", "0"], timeout=5.0)
        assert result.scores == [1.0, 0.0] and time.monotonic() - t < 1.5   # no import on the way
        assert pool.start(lambda r, g: 1.0) == 0   # does not pickle: score() says what to change
    from hflow.rewards.pool import default_workers
    assert 1 <= default_workers() <= 4 and RewardPool(0).num_workers == default_workers()
    scorer = Scorer(RewardConfig(fn="slow_import_scorer:score", num_workers=1))
    try:
        scorer.start()
        assert scorer(["1"], ["1"]).scores == [1.0]   # waits for the start, then scores
        out = capsys.readouterr().out
        assert "starting 1 reward worker processes for slow_import_scorer:score" in out
        assert "1 of 1 reward workers ready in" in out
    finally:
        scorer.close()
