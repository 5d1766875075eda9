"""Partial credit on the chain task: the running totals a step-by-step answer writes, and its final answer.

A 135M model rarely gets a whole chain right, so a final-answer-only reward is 0 for every sample of a group
and GRPO learns nothing. This reward also credits each partial result written as the prompt asks,
`left op right = result` with all three numbers right (SmolLM2 writes them as "13 + 5 = 18", "1. 5 + 5 = 10",
"9 + 9 is 18" or chained "9 + 4 = 13 + 5 = 18"), so a sample that gets the first steps right scores above
one that does not.
"""

from __future__ import annotations

import re

from codraft.rl.parsing import announced_number, last_number, matches_in_order, normalise, same_number
from codraft.rl.tasks import ChainStep, Problem

# One equation `a op b = c` (also "is", "equals"; bold around the result). A lookahead, so that chained equations
# overlap: "9 + 4 = 13 + 5 = 18" holds "9 + 4 = 13" and "13 + 5 = 18". A number does not start inside another
# ("113", "1.13", "-13" read whole) and does not end before more digits or decimals ("13.5" is not 13).
_INT = r"-?\d+(?!\.?\d)"
_EQUATION = re.compile(rf"(?=(?<![\d.\-])({_INT})\s*([+-])\s*(\d+(?!\.?\d))\s*(?:=|\bis\b|\bequals\b)\s*"
                       rf"\**\s*({_INT}))", re.IGNORECASE)

FINAL_WEIGHT = 0.5  # the final answer's share of the reward; the steps share the rest


def written_steps(text: str) -> list[ChainStep]:
    """Every `a op b = c` equation of integers in `text`, in the order written, right or wrong."""
    return [ChainStep(int(a), op, int(b), int(c)) for a, op, b, c in _EQUATION.findall(normalise(text))]


def chain_steps_reward(completion: str, problem: Problem) -> float:
    """In [0, 1]: FINAL_WEIGHT if the answer announces the right number ("Answer: 27", as the prompt asks;
    `parsing.announced_number`), plus the rest times the share of the problem's steps written right and in
    order. 1.0 is every step and the answer; a reward above 0.5 means the final answer is right (and then the
    `final_answer` reward is 1 too). A number merely written last does not count as the answer: in SmolLM2's
    rambling answers it is often a step or a stray number that happens to match."""
    if not problem.steps:
        raise ValueError("the chain_steps reward scores task.kind=chain problems, which carry their steps; "
                         "this problem has none")
    final = same_number(announced_number(completion), last_number(problem.answer))
    share = matches_in_order(problem.steps, written_steps(completion)) / len(problem.steps)
    return FINAL_WEIGHT * final + (1 - FINAL_WEIGHT) * share
