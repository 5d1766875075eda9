import json
import re

import pytest

from codraft.models.presets import byte_tokenizer
from codraft.rl.tasks import ArithmeticTask, JsonlTask, Problem, build_prompt_ids, load_jsonl

EXPRESSION = re.compile(r"What is (.+)\? Answer with the number only\.")


def operands(problem: Problem) -> list[int]:
    return [int(t) for t in EXPRESSION.fullmatch(problem.prompt).group(1).split()[::2]]


def test_default_arithmetic_is_easy_two_term_addition():
    problems = ArithmeticTask().sample(200)
    for p in problems:
        expression = EXPRESSION.fullmatch(p.prompt).group(1)
        a, op, b = expression.split()
        assert op == "+" and 0 <= int(a) <= 20 and 0 <= int(b) <= 20
        assert p.answer == str(int(a) + int(b))
    assert len({p.prompt for p in problems}) > 100  # not a handful of repeats


@pytest.mark.parametrize("operators", ["+-*", "*", "-"])
def test_answers_follow_usual_precedence(operators):
    task = ArithmeticTask(min_operand=0, max_operand=99, num_terms=4, operators=operators, seed=1)
    for p in task.sample(100):
        expression = EXPRESSION.fullmatch(p.prompt).group(1)
        assert set(expression.split()[1::2]) <= set(operators)
        assert p.answer == str(eval(expression))  # Python's evaluator as the oracle


def test_with_digits_sets_operand_range():
    task = ArithmeticTask.with_digits(3, num_terms=3, seed=2)
    values = [v for p in task.sample(50) for v in operands(p)]
    assert all(100 <= v <= 999 for v in values) and len(values) == 150
    assert all(0 <= v <= 9 for p in ArithmeticTask.with_digits(1).sample(50) for v in operands(p))


def test_arithmetic_is_deterministic_per_seed_and_index():
    a, b = ArithmeticTask(seed=7), ArithmeticTask(seed=7)
    assert a.sample(20) == b.sample(20)
    assert a.problem(3) == ArithmeticTask(seed=7).sample(4)[3]
    assert ArithmeticTask(seed=8).sample(20) != ArithmeticTask(seed=7).sample(20)
    it = iter(ArithmeticTask(seed=7))
    assert [next(it) for _ in range(5)] == ArithmeticTask(seed=7).sample(5)


def test_arithmetic_state_round_trips_through_json():
    task = ArithmeticTask(seed=5)
    task.sample(7)
    state = json.loads(json.dumps(task.state_dict()))
    expected = task.sample(3)
    resumed = ArithmeticTask(seed=5)
    resumed.load_state_dict(state)
    assert resumed.sample(3) == expected
    assert state == {"position": 7, "seed": 5}


@pytest.mark.parametrize(
    "kwargs, field",
    [({"num_terms": 1}, "num_terms"), ({"operators": "/"}, "operators"), ({"min_operand": 5, "max_operand": 2},
                                                                           "max_operand")],
)
def test_bad_arithmetic_config_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        ArithmeticTask(**kwargs)


def test_bad_state_is_refused():
    with pytest.raises(ValueError, match="position"):
        ArithmeticTask().load_state_dict({"position": -1})


def write(tmp_path, lines):
    path = tmp_path / "data.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_load_jsonl_reads_rows_and_numeric_answers(tmp_path):
    path = write(tmp_path, ['{"prompt": "2+3?", "answer": "5"}', "", '{"prompt": "1.5*2?", "answer": 3.0}',
                            '{"prompt": "7-9?", "answer": -2, "extra": 1}'])
    assert load_jsonl(path) == [Problem("2+3?", "5"), Problem("1.5*2?", "3.0"), Problem("7-9?", "-2")]


@pytest.mark.parametrize(
    "row, message",
    [
        ('{"prompt": "x"}', r"data\.jsonl:2: missing field 'answer'"),
        ('{"answer": "1"}', r"data\.jsonl:2: missing field 'prompt'"),
        ('{"prompt": 3, "answer": "1"}', r"data\.jsonl:2: field 'prompt' must be a non-empty string"),
        ('{"prompt": "x", "answer": [1]}', r"data\.jsonl:2: field 'answer' must be a string or a number"),
        ('{"prompt": "x", "answer": true}', r"data\.jsonl:2: field 'answer'"),
        ('["x", "1"]', r"data\.jsonl:2: a row must be a JSON object"),
        ('{"prompt": "x", ', r"data\.jsonl:2: not valid JSON"),
    ],
)
def test_load_jsonl_errors_name_file_line_and_field(tmp_path, row, message):
    path = write(tmp_path, ['{"prompt": "ok", "answer": "1"}', row])
    with pytest.raises(ValueError, match=message):
        load_jsonl(path)


def test_empty_dataset_is_a_clear_error(tmp_path):
    for text in ["", "\n\n  \n"]:
        path = tmp_path / "empty.jsonl"
        path.write_text(text)
        with pytest.raises(ValueError, match="no problems"):
            load_jsonl(path)
    with pytest.raises(ValueError, match="at least one problem"):
        JsonlTask([])


def test_jsonl_task_epochs_are_seeded_permutations(tmp_path):
    problems = [Problem(f"q{i}", str(i)) for i in range(10)]
    task = JsonlTask(problems, seed=3)
    first, second = task.sample(10), task.sample(10)
    assert sorted(first, key=lambda p: int(p.answer)) == problems == sorted(second, key=lambda p: int(p.answer))
    assert first != problems and first != second  # shuffled, and differently per epoch
    assert JsonlTask(problems, seed=3).sample(20) == first + second
    assert JsonlTask(problems, seed=4).sample(10) != first
    assert JsonlTask(problems, shuffle=False).sample(12) == problems + problems[:2]


def test_jsonl_task_state_round_trips_across_epochs(tmp_path):
    path = write(tmp_path, [json.dumps({"prompt": f"q{i}", "answer": i}) for i in range(4)])
    task = JsonlTask(path, seed=1)
    task.sample(6)
    state = json.loads(json.dumps(task.state_dict()))
    assert state == {"position": 6, "seed": 1, "num_problems": 4}
    expected = task.sample(5)
    resumed = JsonlTask(path, seed=1)
    resumed.load_state_dict(state)
    assert resumed.sample(5) == expected


def test_build_prompt_ids_applies_chat_template_once():
    tok = byte_tokenizer()
    problem = Problem("What is 2 + 3?", "5")
    ids = build_prompt_ids(tok, problem, chat_template=True)
    text = "<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n<|im_start|>assistant\n"
    assert ids == tok.encode(text, add_special_tokens=False)
    assert ids[0] == 257 and tok.decode(ids) == text
    assert build_prompt_ids(tok, problem, chat_template=False) == tok.encode("What is 2 + 3?")


def test_a_non_utf8_byte_names_file_line_and_column(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_bytes(b'{"prompt": "ok", "answer": "1"}\n{"prompt": "caf\xe9", "answer": "1"}\n')
    with pytest.raises(ValueError, match=r"data\.jsonl:2: not valid UTF-8 \(byte 0xe9 at column 16\)"):
        load_jsonl(path)
