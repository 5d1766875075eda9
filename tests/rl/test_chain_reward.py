"""The chain task's partial-credit reward: equations parsed from real answer formats, steps credited in order."""

import pytest

from codraft.config import ConfigError, load_config
from codraft.rl.chain_reward import chain_steps_reward, written_steps
from codraft.rl.parsing import matches_in_order
from codraft.rl.rewards import answer_correct, final_answer_reward, load_reward_fn, score
from codraft.rl.tasks import ChainStep, Problem

# 9 + 4 + 5 + 9, the e2e config's first prompt
NINE = Problem("q", "27", steps=(ChainStep(9, "+", 4, 13), ChainStep(13, "+", 5, 18), ChainStep(18, "+", 9, 27)))
# 3 - 5 + 4: a running total below zero
NEGATIVE = Problem("q", "2", steps=(ChainStep(3, "-", 5, -2), ChainStep(-2, "+", 4, 2)))


@pytest.mark.parametrize(
    "text, expected",
    [
        ("9 + 4 = 13", [(9, "+", 4, 13)]),
        ("1. 5 + 5 = 10\n2. 10 + 1 = 11.", [(5, "+", 5, 10), (10, "+", 1, 11)]),  # numbered lines, a full stop
        ("9 + 9 is 18, and 18 + 2 equals 20", [(9, "+", 9, 18), (18, "+", 2, 20)]),
        ("9 + 4 = 13 + 5 = 18", [(9, "+", 4, 13), (13, "+", 5, 18)]),  # chained: both equations
        ("9+4=13", [(9, "+", 4, 13)]),
        ("so 13 + 5 = **18**", [(13, "+", 5, 18)]),
        ("3 - 5 = -2\n-2 + 4 = 2", [(3, "-", 5, -2), (-2, "+", 4, 2)]),
        ("3 \u2212 5 = \u22122", [(3, "-", 5, -2)]),  # unicode minus
        ("113 - 5 = 108", [(113, "-", 5, 108)]),  # not "13 - 5 = 108" from inside 113
        ("1.5 + 2 = 3.5", []),  # decimals are not integer steps
        ("9 + 4 = 13.5", []),
        ("9 + 4 + 5 + 9 = 27", [(5, "+", 9, 27)]),  # only the last two terms stand as `a op b = c`
        ("2 * 2 = 4", []),  # not a chain operator
        ("9 + 4 = ", []),
        ("", []),
    ],
)
def test_written_steps_reads_the_formats_smollm2_writes(text, expected):
    assert written_steps(text) == [ChainStep(*e) for e in expected]


@pytest.mark.parametrize(
    "completion, expected",
    [
        ("9 + 4 = 13\n13 + 5 = 18\n18 + 9 = 27\nAnswer: 27", 1.0),  # every step and the answer
        ("9 + 4 = 13\n13 + 5 = 18\n18 + 9 = 27", 0.5),  # every step, no "Answer:" line
        ("9 + 4 = 13\n13 + 5 = 18\n18 + 9 = 27\nAnswer: 26", 0.5),  # every step, a wrong answer
        ("Answer: 27", 0.5),  # the answer alone
        ("9 + 4 = 13", 0.5 / 3),  # the prompt's example step only
        ("9 + 4 = 13\n13 + 5 = 18\nAnswer: 27", 0.5 + 0.5 * 2 / 3),
        ("9 + 4 = 13\n13 + 6 = 19\n19 + 9 = 28\nAnswer: 28", 0.5 / 3),  # one slip: the later steps do not fit it
        ("9 + 4 = 13\n4 + 5 = 9\n9 + 9 = 18", 0.5 / 3),  # sums of the wrong operands
        ("9 + 4 = 13\n9 + 4 = 13\n9 + 4 = 13", 0.5 / 3),  # a step repeated counts once
        ("13 + 5 = 18\n9 + 4 = 13", 0.5 / 3),  # out of order: one of them
        ("9 + 4 = 14\n14 + 5 = 19", 0.0),  # wrong from the start
        ("the sum is large, about twenty-seven", 0.0),  # malformed
        ("... so you multiply by 27 and that is the final answer.", 0.0),  # 27 written last, never announced
        ("", 0.0),
    ],
)
def test_chain_steps_reward_credits_each_right_step_and_the_answer(completion, expected):
    assert chain_steps_reward(completion, NINE) == pytest.approx(expected)


def test_the_top_half_of_the_reward_means_the_final_answer_is_right():
    for completion in ["9 + 4 = 13\n13 + 5 = 18\n18 + 9 = 27\nAnswer: 27", "Answer: 27", "Answer: 26", "9 + 4 = 13"]:
        reward = chain_steps_reward(completion, NINE)
        assert 0.0 <= reward <= 1.0 and (reward >= 0.5) == (final_answer_reward(completion, NINE) == 1.0)


def test_final_answer_accuracy_does_not_follow_the_chain_steps_reward():
    wrong_steps = "9 + 4 = 12\n12 + 5 = 17\n17 + 9 = 26\nAnswer: 27"
    assert answer_correct(wrong_steps, NINE) and chain_steps_reward(wrong_steps, NINE) < 1.0
    wrong_answer = "9 + 4 = 13\n13 + 5 = 18\n18 + 9 = 27\nAnswer: 28"  # every step, then a slip
    assert not answer_correct(wrong_answer, NINE) and chain_steps_reward(wrong_answer, NINE) == 0.5


def test_negative_running_totals_are_credited():
    assert chain_steps_reward("3 - 5 = -2\n-2 + 4 = 2\nAnswer: 2", NEGATIVE) == 1.0
    assert chain_steps_reward("3 - 5 = 2\n2 + 4 = 6\nAnswer: 6", NEGATIVE) == 0.0  # the sign dropped


def test_matches_in_order_is_the_longest_common_subsequence():
    a, b, c = NINE.steps
    assert matches_in_order(NINE.steps, [c, a, b]) == 2 and matches_in_order(NINE.steps, [b, a, c, a]) == 2
    assert matches_in_order((a, a), [a]) == 1 and matches_in_order((a, a), [a, b, a]) == 2  # a repeated step, twice
    assert matches_in_order(NINE.steps, []) == 0


def test_chain_steps_is_a_builtin_and_refuses_problems_without_steps():
    assert load_reward_fn("chain_steps") is chain_steps_reward
    with pytest.raises(ValueError, match="task.kind=chain"):
        chain_steps_reward("Answer: 5", Problem("What is 2 + 3?", "5"))
    rewards, dropped = score(["Answer: 5"], [Problem("What is 2 + 3?", "5")], chain_steps_reward)
    assert rewards == [None] and dropped == 1  # a run on the wrong task drops, and the reward guard stops it


def test_config_refuses_chain_steps_on_other_tasks():
    assert load_config(None, ["task.kind=chain", "task.reward=chain_steps"]).task.reward == "chain_steps"
    with pytest.raises(ConfigError, match="'task.reward' must be a reward for task.kind=arithmetic"):
        load_config(None, ["task.kind=arithmetic", "task.reward=chain_steps"])
