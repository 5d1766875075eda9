"""The list task's reward: how much of the expected list a completion wrote, in order, and nothing else.

A reward for the right list only would be 0 for most of SmolLM2's samples (a count that runs past its end, a copy
that drops one number), so this one is graded: the F1 of in-order matches, 2 m / (expected + written), where m is
how many of the expected numbers the completion wrote in order. Missing numbers lower it, and so do extra ones:
numbers in chatter around the list, a count that does not stop. 1.0 is exactly the list.
"""

from __future__ import annotations

import re

from codraft.rl.parsing import matches_in_order, normalise
from codraft.rl.tasks import Problem

# integers as a list writes them: "23, 24,25" and "23 24" are three and two numbers (no thousands separators)
_INTEGER = re.compile(r"-?\d+")


def written_numbers(text: str) -> list[int]:
    """Every integer in `text`, in the order written."""
    return [int(n) for n in _INTEGER.findall(normalise(text))]


def list_match_reward(completion: str, problem: Problem) -> float:
    """In [0, 1]: 2 m / (len(expected) + len(written)) over the integers of the answer and of the completion."""
    expected = written_numbers(problem.answer)
    if not expected:
        raise ValueError(f"the list_match reward scores answers that are lists of integers, got {problem.answer!r:.80}")
    written = written_numbers(completion)
    return 2 * matches_in_order(expected, written) / (len(expected) + len(written))
