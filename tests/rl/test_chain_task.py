"""The long-answer task: step-by-step chains, their steps, and the rewards that read them (rl/tasks.py,
rl/chain_reward.py, rl/rewards.py)."""

import json
import re
from collections import Counter
from statistics import median

import pytest

from codraft.cli import main
from codraft.config import load_config
from codraft.rl.chain_reward import chain_steps_reward
from codraft.rl.tasks import ChainTask, build_task

CHAIN = re.compile(r'Compute (.+) step by step, from left to right\. Write each partial result on its own line, '
                   r'like "(.+)", and end with "Answer: <number>"\.')


def test_chain_answers_are_left_to_right_totals_and_the_example_is_the_first_step():
    task = ChainTask(min_operand=0, max_operand=99, operators="+-", seed=3)
    for p in task.sample(200):
        expression, first_step = CHAIN.fullmatch(p.prompt).groups()
        tokens = expression.split()
        assert set(tokens[1::2]) <= {"+", "-"} and all(0 <= int(t) <= 99 for t in tokens[::2])
        assert p.answer == str(eval(expression))  # + and - only: Python's left-to-right value
        assert first_step == f"{' '.join(tokens[:3])} = {eval(' '.join(tokens[:3]))}"


def test_chain_lengths_span_the_range_with_a_long_tail():
    counts = Counter(len(CHAIN.fullmatch(p.prompt).group(1).split()[::2]) for p in ChainTask(seed=1).sample(4000))
    assert min(counts) == 4 and max(counts) == 24  # every length of the default range is reached
    assert counts[4] > 2 * counts[12] > 2 * counts[24] > 0  # log-uniform: short ones common, long ones rare
    assert 9 <= median(counts.elements()) <= 11  # sqrt(4 * 25) = 10


def test_chain_is_deterministic_per_seed_and_index_and_resumes():
    assert ChainTask(seed=4).sample(30) == ChainTask(seed=4).sample(30) != ChainTask(seed=5).sample(30)
    task = ChainTask(seed=4)
    task.sample(7)
    resumed = ChainTask(seed=4)
    resumed.load_state_dict(json.loads(json.dumps(task.state_dict())))
    assert resumed.sample(3) == task.sample(3)


@pytest.mark.parametrize(
    "kwargs, field",
    [({"operators": "*"}, "operators"), ({"min_terms": 1}, "min_terms"), ({"min_terms": 5, "max_terms": 4},
     "max_terms"), ({"min_operand": 5, "max_operand": 4}, "max_operand"), ({"template": "{expression}"},
     "first_step")],
)
def test_bad_chain_config_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        ChainTask(**kwargs)


def test_task_kind_chain_builds_the_configured_chain():
    cfg = load_config(None, ["task.kind=chain", "task.chain_min_terms=3", "task.chain_max_terms=3",
                             "task.max_operand=9", "task.operators=-", "run.seed=2"])
    task = build_task(cfg)
    assert isinstance(task, ChainTask) and task.problem(0) == ChainTask(0, 9, 3, 3, "-", seed=2).problem(0)
    assert all(CHAIN.fullmatch(p.prompt).group(1).count(" - ") == 2 for p in task.sample(20))


@pytest.mark.parametrize("reward", ["chain_steps", "final_answer"])
def test_a_chain_run_trains_and_scores_with_either_chain_reward(tmp_path, reward):
    assert main(["train", "model.path=tiny-llama", "task.kind=chain", f"task.reward={reward}", "rl.steps=1",
                 "rl.prompts_per_step=2", "rl.group_size=2", "rl.max_new_tokens=8", "draft.family=none",
                 "run.tensorboard=false", f"run.dir={tmp_path}"]) == 0
    (row,) = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert row["reward/mean"] == 0.0 and row["reward/dropped"] == 0  # a random policy never gets a chain right
    assert row["reward/final_answer_accuracy"] == 0.0


def test_chain_steps_follow_the_expression_and_an_answer_written_as_asked_scores_one():
    for p in ChainTask(min_operand=0, max_operand=20, operators="+-", seed=6).sample(200):
        expression, first_step = CHAIN.fullmatch(p.prompt).groups()
        tokens = expression.split()
        assert first_step == str(p.steps[0]) and len(p.steps) == len(tokens) // 2
        ops_and_terms = zip(tokens[1::2], map(int, tokens[2::2]), strict=True)
        assert [(s.op, s.right) for s in p.steps] == list(ops_and_terms)
        assert [s.left for s in p.steps] == [int(tokens[0])] + [s.result for s in p.steps[:-1]]
        assert all(s.result == eval(f"{s.left} {s.op} {s.right}") for s in p.steps)
        assert str(p.steps[-1].result) == p.answer
        written = "\n".join(map(str, p.steps)) + f"\nAnswer: {p.answer}"
        assert chain_steps_reward(written, p) == 1.0
