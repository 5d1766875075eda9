import logging
import math

import numpy as np
import pytest
import torch

from codraft.rl import rewards
from codraft.rl.rewards import (
    answer_correct,
    combine,
    correctness_reward,
    final_answer_reward,
    final_number,
    format_reward,
    last_number,
    load_reward_fn,
    score,
)
from codraft.rl.tasks import Problem


@pytest.fixture(autouse=True)
def fresh_warnings(monkeypatch):
    monkeypatch.setattr(rewards, "_warned", set())


@pytest.mark.parametrize(
    "completion, answer, expected",
    [
        ("19", "19", 1.0),
        ("The answer is 19.", "19", 1.0),
        ("19.", "19", 1.0),
        ("  19\n", "19", 1.0),
        ("12 + 7 = 19", "19", 1.0),
        ("1,234", "1234", 1.0),
        ("1234", "1,234", 1.0),
        ("The total is 1,234,567.", "1234567", 1.0),
        ("-5", "-5", 1.0),
        ("The answer is -5.", "-5", 1.0),
        ("\u22123", "-3", 1.0),  # unicode minus
        ("12-7=5", "5", 1.0),  # the '-' after a digit is an operator, not a sign
        ("19.0", "19", 1.0),
        ("3.50", "3.5", 1.0),
        ("20, no wait, 19", "19", 1.0),
        ("The answer is 18.", "19", 0.0),
        ("19 apples and 20 pears", "19", 0.0),  # the last number counts
        ("5", "-5", 0.0),
        ("nineteen", "19", 0.0),
        ("", "19", 0.0),
        ("Paris.", "paris", 1.0),  # free-text answers compare as text
        ("Lyon", "Paris", 0.0),
    ],
)
def test_correctness_on_tricky_strings(completion, answer, expected):
    assert correctness_reward(completion, Problem("q", answer)) == expected


@pytest.mark.parametrize(
    "completion, expected",
    [
        ("12 + 7 = 19\n19 + 5 = 24\nAnswer: 24", 24.0),
        ("12 + 7 = 19\n19 + 5 = 24\n= 24", 24.0),  # no marker: the last number
        ("12 + 7 = 19\n19 + 5 = 24\nThe answer is 24.", 24.0),
        ("Answer: 24. I checked all 3 steps twice.", 24.0),  # numbers after the announced answer do not count
        ("The final answer is **24**.", 24.0),
        ("**Answer:** $-3$ (not 4)", -3.0),
        ("answer = 1,234\nDone in 2 steps", 1234.0),
        ("Answer: 19\nWait, 19 + 5 = 24. Answer: 24", 24.0),  # the last marker counts
        ("The answer to 12 + 7 is 19", 19.0),  # "answer to ..." announces nothing: the last number
        ("I answered 3 of them: 5", 5.0),
        ("Answer: none", None),
        ("", None),
    ],
)
def test_final_number_reads_the_announced_answer_else_the_last_number(completion, expected):
    assert final_number(completion) == expected


def test_final_answer_reward_scores_the_final_number_only():
    p = Problem("q", "24")
    assert final_answer_reward("12 + 7 = 19\n19 + 5 = 24\nAnswer: 24. That took 2 steps.", p) == 1.0
    assert correctness_reward("12 + 7 = 19\n19 + 5 = 24\nAnswer: 24. That took 2 steps.", p) == 0.0  # last number: 2
    assert final_answer_reward("12 + 7 = 19\n19 + 5 = 24\nAnswer: 23", p) == 0.0  # a right partial sum is not enough
    assert final_answer_reward("no numbers", p) == 0.0
    assert final_answer_reward("Answer: 24", Problem("q", "no number")) == 0.0
    assert load_reward_fn("final_answer") is final_answer_reward


@pytest.mark.parametrize(
    "completion, answer, expected",
    [
        ("19", "19", True),  # the arithmetic task's bare number
        ("12 + 7 = 19", "19", True),  # no "Answer:": the last number
        ("Answer: 24. That took 2 steps.", "24", True),  # the announced number, not the last
        ("Answer: 23", "24", False),
        ("no numbers", "24", False),
        (" Paris. ", "paris", True),  # a free-text answer: compared as text
        ("Lyon", "Paris", False),
    ],
)
def test_answer_correct_reads_the_final_answer_of_every_task_kind(completion, answer, expected):
    assert answer_correct(completion, Problem("q", answer)) is expected


def test_last_number():
    assert last_number("a 1,000 b -2.5 c") == -2.5
    assert last_number("no digits") is None


@pytest.mark.parametrize(
    "completion, expected", [("19", 0.1), (" 19. ", 0.1), ("-1,234", 0.1), ("The answer is 19", 0.0), ("", 0.0)]
)
def test_format_reward_rewards_bare_numbers(completion, expected):
    assert format_reward(completion, Problem("q", "19")) == expected


def test_combine_sums_with_weights():
    p = Problem("q", "19")
    assert combine(correctness_reward, format_reward)("19", p) == pytest.approx(1.1)
    assert combine(correctness_reward, format_reward, weights=[2.0, 0.0])("19", p) == 2.0
    with pytest.raises(ValueError, match="weights"):
        combine(correctness_reward, weights=[1.0, 2.0])


def test_load_reward_fn_builtins_modules_and_files(tmp_path):
    assert load_reward_fn("correctness") is correctness_reward
    assert load_reward_fn("correctness+format")("19", Problem("q", "19")) == pytest.approx(1.1)
    assert load_reward_fn("codraft.rl.rewards:format_reward") is format_reward
    path = tmp_path / "my_reward.py"
    path.write_text("def length(completion, problem):\n    return float(len(completion))\n")
    assert load_reward_fn(f"{path}:length")("abc", Problem("q", "1")) == 3.0


@pytest.mark.parametrize(
    "spec, message",
    [
        ("no_colon_here", "expected 'package.module:function'"),
        ("codraft.no_such_module:fn", "cannot import module 'codraft.no_such_module'"),
        ("codraft.rl.rewards:no_such_fn", "has no attribute 'no_such_fn'"),
        ("codraft.rl.rewards:BUILTIN_REWARDS", "not a callable"),
        ("missing_file.py:fn", "does not exist"),
    ],
)
def test_load_reward_fn_errors_are_clear(spec, message):
    with pytest.raises(ValueError, match=message):
        load_reward_fn(spec)


def flaky(completion: str, problem: Problem):
    return {
        "raise": lambda: 1 / 0,
        "nan": lambda: math.nan,
        "inf": lambda: math.inf,
        "string": lambda: "1.0",
        "none": lambda: None,
        "numpy": lambda: np.float32(0.5),
        "tensor": lambda: torch.tensor(0.25),
        "bool": lambda: True,
    }.get(completion, lambda: 1.0)()


def test_score_drops_bad_rewards_with_counts_and_warns_once_per_kind(caplog):
    completions = ["ok", "raise", "nan", "string", "inf", "none", "numpy", "tensor", "bool", "raise"]
    problems = [Problem("q", "1")] * len(completions)
    with caplog.at_level(logging.WARNING, logger="codraft.rl.rewards"):
        got, dropped = score(completions, problems, flaky)
        assert got == [1.0, None, None, None, None, None, 0.5, 0.25, 1.0, None]
        assert dropped == 6
        first = len(caplog.records)
        got, dropped = score(completions, problems, flaky)  # same kinds again: counted, not logged
    assert dropped == 6
    assert first == 4 and len(caplog.records) == 4  # ZeroDivisionError, non-finite, str, NoneType
    text = caplog.text
    assert "raised ZeroDivisionError" in text and "non-finite value (nan)" in text
    assert "returned str '1.0', not a number" in text and "returned NoneType" in text


def test_score_checks_lengths():
    with pytest.raises(ValueError, match="2 completions but 1 problems"):
        score(["a", "b"], [Problem("q", "1")], correctness_reward)
