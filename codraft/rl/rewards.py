"""Rewards: `RewardFn(completion_text, problem) -> float`, built-ins, user plug-ins and safe scoring.

A user's reward function may raise or return garbage on some completions; `score` drops those
samples (reward None), counts them and warns once per kind, so a run never dies on a reward bug.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import math
import numbers
import re
import sys
from collections.abc import Callable
from pathlib import Path

from codraft.rl.chain_reward import chain_steps_reward
from codraft.rl.list_reward import list_match_reward
from codraft.rl.parsing import NUMBER, final_number, last_number, normalise, same_number
from codraft.rl.tasks import Problem

log = logging.getLogger(__name__)

RewardFn = Callable[[str, Problem], float]

_ONLY_NUMBER = re.compile(rf"\s*(?:{NUMBER.pattern})\.?\s*")


def correctness_reward(completion: str, problem: Problem) -> float:
    """1.0 if the completion's last number equals the answer numerically, else 0.0.

    An answer with no number in it (free-text user data) is compared as text: the completion, stripped
    of surrounding space and a trailing period, must equal it ignoring case.
    """
    expected = last_number(problem.answer)
    if expected is None:
        return float(_same_text(completion, problem.answer))
    return float(same_number(last_number(completion), expected))


def final_answer_reward(completion: str, problem: Problem) -> float:
    """1.0 if the completion's `final_number` equals the answer numerically, else 0.0 (the chain task's reward)."""
    return float(same_number(final_number(completion), last_number(problem.answer)))


def answer_correct(completion: str, problem: Problem) -> bool:
    """Whether the completion's final answer is the problem's, whatever reward the run trains on (the
    `reward/final_answer_accuracy` metric): its `final_number` ("Answer: 57", else the last number) equals the
    answer numerically; an answer with no number in it (free-text user data) is compared as text, as
    `correctness_reward` does."""
    if last_number(problem.answer) is None:
        return _same_text(completion, problem.answer)
    return final_answer_reward(completion, problem) == 1.0


def _same_text(completion: str, answer: str) -> bool:
    """Equal ignoring surrounding space, a trailing period and case."""
    return completion.strip().rstrip(".").casefold() == answer.strip().rstrip(".").casefold()


def format_reward(completion: str, problem: Problem, bonus: float = 0.1) -> float:
    """`bonus` if the completion is a bare number (an optional trailing period allowed), else 0.0."""
    return bonus if _ONLY_NUMBER.fullmatch(normalise(completion)) else 0.0


def combine(*fns: RewardFn, weights: list[float] | None = None) -> RewardFn:
    """Weighted sum of reward functions (weights default to 1.0 each)."""
    if not fns:
        raise ValueError("combine() needs at least one reward function")
    weights = [1.0] * len(fns) if weights is None else list(weights)
    if len(weights) != len(fns):
        raise ValueError(f"combine() got {len(fns)} reward functions but {len(weights)} weights")

    def combined(completion: str, problem: Problem) -> float:
        return sum(w * fn(completion, problem) for w, fn in zip(weights, fns, strict=True))

    combined.__name__ = "+".join(getattr(fn, "__name__", "reward") for fn in fns)
    return combined


BUILTIN_REWARDS: dict[str, RewardFn] = {
    "correctness": correctness_reward,
    "correctness+format": combine(correctness_reward, format_reward),
    "final_answer": final_answer_reward,
    "chain_steps": chain_steps_reward,
    "list_match": list_match_reward,
}


def load_reward_fn(spec: str) -> RewardFn:
    """A built-in name (see BUILTIN_REWARDS), "package.module:function" or "path/to/file.py:function"."""
    if spec in BUILTIN_REWARDS:
        return BUILTIN_REWARDS[spec]
    module_name, sep, attr = spec.rpartition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"reward function {spec!r}: expected 'package.module:function', 'path/to/file.py:function' "
                         f"or a built-in ({', '.join(BUILTIN_REWARDS)})")
    if module_name.endswith(".py"):
        path = Path(module_name)
        if not path.is_file():
            raise ValueError(f"reward function {spec!r}: file {path} does not exist")
        file_spec = importlib.util.spec_from_file_location(f"codraft_user_reward_{path.stem}", path)
        assert file_spec is not None and file_spec.loader is not None
        module = importlib.util.module_from_spec(file_spec)
        sys.modules[file_spec.name] = module
        file_spec.loader.exec_module(module)
    else:
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as e:
            raise ValueError(f"reward function {spec!r}: cannot import module {module_name!r} ({e})") from e
    fn = getattr(module, attr, None)
    if fn is None:
        raise ValueError(f"reward function {spec!r}: module {module_name!r} has no attribute {attr!r}")
    if not callable(fn):
        raise ValueError(f"reward function {spec!r}: {attr!r} is a {type(fn).__name__}, not a callable")
    return fn


_warned: set[str] = set()  # (function, kind) pairs already warned about in this process


def _warn_once(fn: RewardFn, kind: str, detail: str) -> None:
    key = f"{getattr(fn, '__name__', repr(fn))}:{kind}"
    if key not in _warned:
        _warned.add(key)
        log.warning("reward function %s %s; the sample is dropped (further cases are counted, not logged)",
                    key.split(":")[0], detail)


def _as_reward(value: object) -> float | None:
    if isinstance(value, numbers.Real):
        return float(value)
    item = getattr(value, "item", None)  # 0-d tensors / numpy scalars that are not numbers.Real
    if callable(item) and getattr(value, "ndim", None) == 0:
        out = item()
        return float(out) if isinstance(out, numbers.Real) else None
    return None


def _reward_or_reason(fn: RewardFn, completion: str, problem: Problem) -> tuple[float | None, tuple[str, str] | None]:
    """(reward, None), or (None, (kind, detail)) for a sample that must be dropped."""
    try:
        value = fn(completion, problem)
    except Exception as e:  # a user's bug must not kill the run
        return None, (f"raised {type(e).__name__}", f"raised {type(e).__name__}: {e}")
    reward = _as_reward(value)
    if reward is None:
        kind = f"returned {type(value).__name__}"
        return None, (kind, f"{kind} {value!r:.80}, not a number")
    if not math.isfinite(reward):
        return None, ("non-finite", f"returned a non-finite value ({reward})")
    return reward, None


def score(completions: list[str], problems: list[Problem], fn: RewardFn,
          errors: list[str] | None = None) -> tuple[list[float | None], int]:
    """Rewards per completion; None (and counted in `dropped`) where `fn` raised or gave a non-finite non-number.
    `errors`, when given, receives why each dropped sample was dropped, in order."""
    if len(completions) != len(problems):
        raise ValueError(f"score() got {len(completions)} completions but {len(problems)} problems")
    rewards: list[float | None] = []
    for completion, problem in zip(completions, problems, strict=True):
        reward, why = _reward_or_reason(fn, completion, problem)
        if why is not None:
            _warn_once(fn, *why)
            if errors is not None:
                errors.append(why[1])
        rewards.append(reward)
    return rewards, sum(r is None for r in rewards)
