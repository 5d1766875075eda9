"""The list task: counts and copies, their answers, and the reward that reads them (rl/tasks.py, rl/list_reward.py)."""

import json
import re
from collections import Counter

import pytest

from codraft.cli import main
from codraft.config import ConfigError, load_config
from codraft.rl.list_reward import list_match_reward, written_numbers
from codraft.rl.rewards import load_reward_fn
from codraft.rl.tasks import ListTask, Problem, build_task

COUNT = re.compile(r"Count from (\d+) to (\d+), writing the numbers separated by commas\.")
COPY = re.compile(r"Repeat this list of numbers exactly, separated by commas: (.+)\.")
FIVE = Problem("q", "23, 24, 25, 26, 27")


def test_counts_and_copies_alternate_and_their_answers_are_the_lists_asked_for():
    task = ListTask(min_length=3, max_length=12, max_number=40, seed=1)
    for i, p in enumerate(task.sample(200)):
        numbers = [int(n) for n in p.answer.split(", ")]
        assert 3 <= len(numbers) <= 12 and all(1 <= n <= 40 for n in numbers)
        if i % 2 == 0:
            first, last = map(int, COUNT.fullmatch(p.prompt).groups())
            assert numbers == list(range(first, last + 1))
        else:
            assert COPY.fullmatch(p.prompt).group(1) == p.answer
        assert list_match_reward(p.answer, p) == 1.0


def test_list_lengths_are_log_uniform_with_a_long_tail():
    counts = Counter(len(p.answer.split(", ")) for p in ListTask(seed=2).sample(4000))
    assert min(counts) == 5 and max(counts) == 24
    assert counts[5] > 1.5 * counts[12] and counts[12] > 1.5 * counts[24] > 0  # P(n) ~ log((n + 1) / n)


def test_the_list_task_is_deterministic_per_seed_and_index():
    assert ListTask(seed=4).sample(30) == ListTask(seed=4).sample(30) != ListTask(seed=5).sample(30)


@pytest.mark.parametrize(
    "completion, expected",
    [
        ("23, 24, 25, 26, 27", 1.0),
        ("23,24,25,26,27.", 1.0),
        ("Sure! Here are the numbers: 23, 24, 25, 26, 27", 1.0),  # chatter without numbers costs nothing
        ("23, 24, 25, 26, 27, 28, 29, 30, 31, 32", 2 * 5 / 15),  # a count that runs past its end
        ("1, 2, 3, ..., 23, 24, 25, 26, 27", 2 * 5 / 13),  # started from 1
        ("23, 24, 26, 27", 2 * 4 / 9),  # one dropped
        ("27, 26, 25, 24, 23", 2 * 1 / 10),  # reversed: one in order
        ("23, 23, 23, 23, 23", 2 * 1 / 10),  # a number repeated counts once
        ("I can help with that.", 0.0),
        ("", 0.0),
    ],
)
def test_list_match_is_the_f1_of_numbers_written_in_order(completion, expected):
    assert list_match_reward(completion, FIVE) == pytest.approx(expected)


def test_written_numbers_reads_lists_as_written():
    assert written_numbers("98,100, 101 -3\u22124") == [98, 100, 101, -3, -4]  # no thousands separators


def test_an_answer_that_is_not_a_list_of_numbers_is_an_error():
    with pytest.raises(ValueError, match="lists of integers"):
        list_match_reward("1, 2", Problem("q", "none"))


def test_task_kind_lists_builds_the_configured_task_and_its_reward():
    cfg = load_config(None, ["task.kind=lists", "task.list_min_length=4", "task.list_max_length=9",
                             "task.list_max_number=50", "run.seed=3"])
    task = build_task(cfg)
    assert isinstance(task, ListTask) and task.sample(5) == ListTask(4, 9, 50, seed=3).sample(5)
    assert load_reward_fn(cfg.task.reward_spec) is list_match_reward


@pytest.mark.parametrize("kind, reward", [("arithmetic", "correctness"), ("jsonl", "correctness"),
                                          ("chain", "chain_steps"), ("lists", "list_match")])
def test_reward_auto_is_the_task_kinds_own(kind, reward, tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "p", "answer": "1"}\n')
    assert load_config(None, [f"task.kind={kind}", f"task.path={data}"]).task.reward_spec == reward
    assert load_config(None, [f"task.kind={kind}", f"task.path={data}", "task.reward=final_answer"]
                       ).task.reward_spec == "final_answer"


@pytest.mark.parametrize("override, field", [("task.list_min_length=0", "task.list_min_length"),
                                             ("task.list_max_length=2", "task.list_max_length"),
                                             ("task.list_max_number=20", "task.list_max_number")])
def test_bad_list_config_names_the_field(override, field):
    with pytest.raises(ConfigError, match=field):
        load_config(None, ["task.kind=lists", override])


def test_a_lists_run_trains_and_scores(tmp_path):
    assert main(["train", "model.path=tiny-llama", "task.kind=lists", "rl.steps=1", "rl.prompts_per_step=2",
                 "rl.group_size=2", "rl.max_new_tokens=8", "draft.family=none", "run.tensorboard=false",
                 f"run.dir={tmp_path}"]) == 0
    (row,) = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert 0.0 <= row["reward/mean"] < 1.0 and row["reward/dropped"] == 0
