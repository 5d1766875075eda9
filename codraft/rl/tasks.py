"""Prompt sources for RL: embedded generators (short arithmetic answers, long step-by-step chains, long lists of
numbers) and user JSONL data.

Every task is an indexed, deterministic stream: `problem(i)` depends only on the
task's config, its seed and `i`, and the task keeps a position that `sample(n)`
and iteration advance. The trainer checkpoints that position with
`state_dict()` (plain JSON ints) and resumes it with `load_state_dict()`.
"""

from __future__ import annotations

import logging
import math
import random
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple, Protocol

from codraft.config import Config, ConfigError
from codraft.jsonl import read_jsonl

log = logging.getLogger(__name__)

DEFAULT_TEMPLATE = "What is {expression}? Answer with the number only."
_OPERATORS = "+-*"


class ChainStep(NamedTuple):
    """One written partial result of a chain, `left op right = result` (e.g. 13 + 5 = 18)."""

    left: int
    op: str  # "+" or "-"
    right: int
    result: int

    def __str__(self) -> str:
        return f"{self.left} {self.op} {self.right} = {self.result}"


@dataclass(frozen=True)
class Problem:
    prompt: str  # the user message
    answer: str  # reference answer as text, e.g. "19"
    source: str | None = field(default=None, compare=False)  # where it was read, e.g. "data.jsonl:3"
    steps: tuple[ChainStep, ...] = ()  # the worked steps the answer should show (chain task), in order


class PromptTokenizer(Protocol):
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...
    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str: ...


def build_prompt_ids(tokenizer: PromptTokenizer, problem: Problem, chat_template: bool) -> list[int]:
    """Token ids of the prompt: the problem as one user turn of the chat template, or the raw prompt text.

    A rendered template already holds the special tokens it wants (BOS, turn markers), so it is encoded
    without adding more, as transformers' `apply_chat_template(tokenize=True)` does.
    """
    if chat_template:
        text = tokenizer.apply_chat_template([{"role": "user", "content": problem.prompt}], add_generation_prompt=True)
        return tokenizer.encode(text, add_special_tokens=False)
    return tokenizer.encode(problem.prompt)


class IndexedTask:
    """Position bookkeeping shared by all tasks; subclasses define `problem(index)`."""

    def __init__(self, seed: int):
        self.seed = seed
        self.position = 0

    def problem(self, index: int) -> Problem:
        raise NotImplementedError

    def sample(self, n: int) -> list[Problem]:
        """The next `n` problems; advances the position by `n`."""
        if n < 0:
            raise ValueError(f"sample(n) needs n >= 0, got {n}")
        out = [self.problem(self.position + i) for i in range(n)]
        self.position += n
        return out

    def __iter__(self) -> Iterator[Problem]:
        return self

    def __next__(self) -> Problem:
        return self.sample(1)[0]

    def state_dict(self) -> dict[str, int]:
        return {"position": self.position, "seed": self.seed}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        position = state.get("position")
        if not isinstance(position, int) or isinstance(position, bool) or position < 0:
            raise ValueError(f"task state 'position' must be an int >= 0, got {position!r}")
        if state.get("seed", self.seed) != self.seed:
            log.warning("task state was saved with seed %s, this task has seed %s: resuming position %d of "
                        "a different stream", state["seed"], self.seed, position)
        self.position = position


class ArithmeticTask(IndexedTask):
    """`num_terms` integers drawn from [min_operand, max_operand] joined by operators drawn from `operators`.

    The default (two terms in 0..20, `+` only) is easy enough that a 135M instruct model's reward rises
    within minutes. Harder: more terms, wider operands (`with_digits`), `-` and `*` (usual precedence).
    """

    def __init__(self, min_operand: int = 0, max_operand: int = 20, num_terms: int = 2, operators: str = "+",
                 seed: int = 0, template: str = DEFAULT_TEMPLATE):
        super().__init__(seed)
        if min_operand < 0 or max_operand < min_operand:
            raise ValueError(f"need 0 <= min_operand <= max_operand, got min_operand={min_operand}, "
                             f"max_operand={max_operand}")
        if num_terms < 2:
            raise ValueError(f"num_terms must be >= 2, got {num_terms}")
        if not operators or any(op not in _OPERATORS for op in operators):
            raise ValueError(f"operators must be a non-empty string of {_OPERATORS!r}, got {operators!r}")
        if "{expression}" not in template:
            raise ValueError(f"template must contain '{{expression}}', got {template!r}")
        self.min_operand, self.max_operand = min_operand, max_operand
        self.num_terms, self.operators, self.template = num_terms, operators, template

    @classmethod
    def with_digits(cls, digits: int, num_terms: int = 2, operators: str = "+", seed: int = 0,
                    template: str = DEFAULT_TEMPLATE) -> ArithmeticTask:
        """Operands with exactly `digits` digits (1 digit: 0..9)."""
        if digits < 1:
            raise ValueError(f"digits must be >= 1, got {digits}")
        low = 0 if digits == 1 else 10 ** (digits - 1)
        return cls(low, 10**digits - 1, num_terms, operators, seed, template)

    def problem(self, index: int) -> Problem:
        rng = random.Random(f"arithmetic:{self.seed}:{index}")  # str seeds hash with sha512: stable across runs
        terms = [rng.randint(self.min_operand, self.max_operand) for _ in range(self.num_terms)]
        ops = [rng.choice(self.operators) for _ in range(self.num_terms - 1)]
        expression = str(terms[0]) + "".join(f" {op} {t}" for op, t in zip(ops, terms[1:], strict=True))
        return Problem(self.template.format(expression=expression), str(_evaluate(terms, ops)))


def _evaluate(terms: list[int], ops: list[str]) -> int:
    """Value of terms[0] ops[0] terms[1] ... with `*` binding tighter than `+` and `-`."""
    total, sign, product = 0, 1, terms[0]
    for op, term in zip(ops, terms[1:], strict=True):
        if op == "*":
            product *= term
        else:
            total += sign * product
            sign, product = (1 if op == "+" else -1), term
    return total + sign * product


def load_jsonl(path: str | Path) -> list[Problem]:
    """Problems from a JSONL file of `{"prompt": str, "answer": str | number}` rows (blank lines skipped)."""
    problems = []
    for where, row in read_jsonl(path):
        if not isinstance(row, dict):
            raise ValueError(f"{where}: a row must be a JSON object with 'prompt' and 'answer', "
                             f"got {type(row).__name__}")
        for name in ("prompt", "answer"):
            if name not in row:
                raise ValueError(f"{where}: missing field '{name}'")
        prompt, answer = row["prompt"], row["answer"]
        if not isinstance(prompt, str) or not prompt.strip():
            raise ValueError(f"{where}: field 'prompt' must be a non-empty string, got {prompt!r:.80}")
        if isinstance(answer, bool) or not isinstance(answer, str | int | float):
            raise ValueError(f"{where}: field 'answer' must be a string or a number, "
                             f"got {type(answer).__name__}")
        problems.append(Problem(prompt, str(answer), source=where))
    if not problems:
        raise ValueError(f"{path}: no problems (the file is empty); expected one JSON object per line "
                         'like {"prompt": "What is 2 + 3?", "answer": "5"}')
    return problems


class JsonlTask(IndexedTask):
    """Epochs over a fixed list of problems, each epoch in its own seeded order (or file order)."""

    def __init__(self, problems: list[Problem] | str | Path, seed: int = 0, shuffle: bool = True):
        super().__init__(seed)
        self.problems = load_jsonl(problems) if isinstance(problems, str | Path) else list(problems)
        if not self.problems:
            raise ValueError("JsonlTask needs at least one problem")
        self.shuffle = shuffle
        self._order: tuple[int, list[int]] | None = None  # (epoch, permutation) cache

    def _permutation(self, epoch: int) -> list[int]:
        if self._order is None or self._order[0] != epoch:
            order = list(range(len(self.problems)))
            if self.shuffle:
                random.Random(f"jsonl:{self.seed}:{epoch}").shuffle(order)
            self._order = (epoch, order)
        return self._order[1]

    def problem(self, index: int) -> Problem:
        epoch, offset = divmod(index, len(self.problems))
        return self.problems[self._permutation(epoch)[offset]]

    def state_dict(self) -> dict[str, int]:
        return {**super().state_dict(), "num_problems": len(self.problems)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        if state.get("num_problems", len(self.problems)) != len(self.problems):
            log.warning("task state was saved with %s problems, the dataset now has %d: the epoch order differs",
                        state["num_problems"], len(self.problems))


def log_uniform(rng: random.Random, low: int, high: int) -> int:
    """An int in [low, high], log-uniform: P(n) is proportional to log((n + 1) / n), so most draws are short and a
    tail is long."""
    n = math.exp(rng.uniform(math.log(low), math.log(high + 1)))
    return min(int(n), high)


CHAIN_TEMPLATE = ("Compute {expression} step by step, from left to right. Write each partial result on its own "
                  'line, like "{first_step}", and end with "Answer: <number>".')


class ChainTask(IndexedTask):
    """Long answers: a chain of integers added (or subtracted) left to right, one written partial result per step.

    The number of terms of each problem is drawn log-uniformly from [min_terms, max_terms], so most answers are
    short and a tail is long: with the defaults (4..24 terms of 0..20) an answer written as asked takes about
    35 / 100 / 230 tokens (10th / 50th / 90th percentile, SmolLM2's tokenizer; give rollouts
    `rl.max_new_tokens=256` or more). `operators` may hold `+` and `-` only: a partial result is the running total.
    The reference answer is the final total, and `Problem.steps` holds the partial results in order, one
    `ChainStep` per operator (the first is the prompt's example). Two rewards read them (rl/chain_reward.py,
    rl/rewards.py): `chain_steps` gives partial credit, half for the share of steps written right and in order
    ("13 + 5 = 18"), half for the right number after "Answer:", so a reward above 0.5 means the final answer is
    right;
    `final_answer` scores the number the answer ends on only (0 or 1).
    """

    def __init__(self, min_operand: int = 0, max_operand: int = 20, min_terms: int = 4, max_terms: int = 24,
                 operators: str = "+", seed: int = 0, template: str = CHAIN_TEMPLATE):
        super().__init__(seed)
        if min_operand < 0 or max_operand < min_operand:
            raise ValueError(f"need 0 <= min_operand <= max_operand, got min_operand={min_operand}, "
                             f"max_operand={max_operand}")
        if not 2 <= min_terms <= max_terms:
            raise ValueError(f"need 2 <= min_terms <= max_terms, got min_terms={min_terms}, max_terms={max_terms}")
        if not operators or any(op not in "+-" for op in operators):
            raise ValueError(f"operators must be a non-empty string of '+-', got {operators!r}")
        for name in ("{expression}", "{first_step}"):
            if name not in template:
                raise ValueError(f"template must contain '{name}', got {template!r}")
        self.min_operand, self.max_operand = min_operand, max_operand
        self.min_terms, self.max_terms, self.operators, self.template = min_terms, max_terms, operators, template

    def problem(self, index: int) -> Problem:
        rng = random.Random(f"chain:{self.seed}:{index}")  # str seeds hash with sha512: stable across runs
        num_terms = log_uniform(rng, self.min_terms, self.max_terms)
        terms = [rng.randint(self.min_operand, self.max_operand) for _ in range(num_terms)]
        ops = [rng.choice(self.operators) for _ in terms[1:]]
        expression = str(terms[0]) + "".join(f" {op} {t}" for op, t in zip(ops, terms[1:], strict=True))
        steps, total = [], terms[0]
        for op, term in zip(ops, terms[1:], strict=True):
            steps.append(ChainStep(total, op, term, total + term if op == "+" else total - term))
            total = steps[-1].result
        prompt = self.template.format(expression=expression, first_step=str(steps[0]))
        return Problem(prompt, str(total), steps=tuple(steps))


COUNT_TEMPLATE = "Count from {first} to {last}, writing the numbers separated by commas."
COPY_TEMPLATE = "Repeat this list of numbers exactly, separated by commas: {numbers}."


class ListTask(IndexedTask):
    """Long answers SmolLM2 gets partly right and learns to get right: write a list of numbers, counting up
    (even indices: "Count from 23 to 41, ...") or copying the prompt's list (odd indices: "Repeat this list ...").

    The list's length is log-uniform in [min_length, max_length] and its numbers lie in [1, max_number] (a count
    starts low enough to end there). The reference answer is the list, "23, 24, 25"; the `list_match` reward
    (rl/list_reward.py) scores how much of it a completion wrote, in order, and nothing else. With the defaults
    (5-24 numbers up to 99) an answer written as asked takes about 15-70 tokens, and SmolLM2-135M at temperature
    0.7 writes some lists exactly, runs past the end of others or repeats the wrong numbers: groups of 4 samples
    seldom score alike until all four are right.
    """

    def __init__(self, min_length: int = 5, max_length: int = 24, max_number: int = 99, seed: int = 0):
        super().__init__(seed)
        if not 1 <= min_length <= max_length:
            raise ValueError(f"need 1 <= min_length <= max_length, got min_length={min_length}, "
                             f"max_length={max_length}")
        if max_number < max_length:
            raise ValueError(f"max_number must be >= max_length (a count of max_length numbers from 1 fits), got "
                             f"max_number={max_number}, max_length={max_length}")
        self.min_length, self.max_length, self.max_number = min_length, max_length, max_number

    def problem(self, index: int) -> Problem:
        rng = random.Random(f"lists:{self.seed}:{index}")  # str seeds hash with sha512: stable across runs
        n = log_uniform(rng, self.min_length, self.max_length)
        if index % 2 == 0:
            first = rng.randint(1, self.max_number - n + 1)
            numbers = list(range(first, first + n))
            prompt = COUNT_TEMPLATE.format(first=first, last=numbers[-1])
        else:
            numbers = [rng.randint(1, self.max_number) for _ in range(n)]
            prompt = COPY_TEMPLATE.format(numbers=", ".join(map(str, numbers)))
        return Problem(prompt, ", ".join(map(str, numbers)))


def _task_args(cfg: Config) -> dict:
    """The task fields `build_task` passes to task.kind's class: with run.seed, all that decides which problems it
    draws, in order (task.reward and task.chat_template change how a problem is scored or shown, not which)."""
    t = cfg.task
    if t.kind == "chain":
        return dict(min_operand=t.min_operand, max_operand=t.max_operand, min_terms=t.chain_min_terms,
                    max_terms=t.chain_max_terms, operators=t.operators)
    if t.kind == "lists":
        return dict(min_length=t.list_min_length, max_length=t.list_max_length, max_number=t.list_max_number)
    if t.kind == "jsonl":
        return dict(problems=t.path)
    return dict(min_operand=t.min_operand, max_operand=t.max_operand, num_terms=t.num_terms, operators=t.operators)


def task_stream(cfg: Config) -> dict:
    """The identity of the problem stream `build_task(cfg)` draws (a JSONL file by its absolute path)."""
    args = _task_args(cfg)
    if cfg.task.kind == "jsonl":
        args["problems"] = str(Path(args["problems"]).resolve())
    return {"kind": cfg.task.kind, **args, "seed": cfg.run.seed}


TASKS: dict[str, type[IndexedTask]] = {"arithmetic": ArithmeticTask, "chain": ChainTask, "lists": ListTask,
                                       "jsonl": JsonlTask}


def build_task(cfg: Config) -> IndexedTask:
    try:
        return TASKS[cfg.task.kind](**_task_args(cfg), seed=cfg.run.seed)
    except ValueError as e:
        if cfg.task.kind != "jsonl":
            raise
        raise ConfigError(f"task.path {e}") from e  # the row and field at fault
