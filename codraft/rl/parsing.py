"""Numbers read out of completions: the last one written, the one a worked answer announces, equality; and how
much of an expected sequence a completion wrote in order."""

from __future__ import annotations

import math
import re
from collections.abc import Sequence

# A number: optional sign (not after a digit, so "12-7" reads as 12 and 7), thousands groups or plain digits,
# optional decimals.
NUMBER = re.compile(r"(?:(?<!\d)-)?(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?")

# "answer" then optionally "is", ":" or "=", then markup (bold, $, brackets) up to the number it announces
_ANSWER = re.compile(rf"answer\s*(?:is\b)?\s*[:=]?[\s*$`(\[]*({NUMBER.pattern})", re.IGNORECASE)


def normalise(text: str) -> str:
    return text.replace("\u2212", "-")  # unicode minus sign


def last_number(text: str) -> float | None:
    """The last number written in `text` ("The answer is -1,234." -> -1234.0), or None."""
    matches = NUMBER.findall(normalise(text))
    return float(matches[-1].replace(",", "")) if matches else None


def announced_number(text: str) -> float | None:
    """The number right after the last "answer" marker ("Answer: 57", "The final answer is **57**."), or None.

    Text after it ("Answer: 57. I checked each of the 5 steps.") does not count.
    """
    announced = _ANSWER.findall(normalise(text))
    return float(announced[-1].replace(",", "")) if announced else None


def final_number(text: str) -> float | None:
    """The number a worked answer ends on: its `announced_number`, else its last number ("... = 57"); None if
    it holds no number."""
    announced = announced_number(text)
    return announced if announced is not None else last_number(text)


def same_number(got: float | None, expected: float | None) -> bool:
    """Both present and numerically equal (up to float rounding)."""
    return got is not None and expected is not None and math.isclose(got, expected, rel_tol=1e-9, abs_tol=1e-9)


def matches_in_order(expected: Sequence, written: Sequence) -> int:
    """How many items of `expected` appear in `written` in the same order (their longest common subsequence):
    an item repeated, or written out of order, earns nothing more."""
    previous = [0] * (len(written) + 1)
    for item in expected:
        row = [0]
        for j, seen in enumerate(written):
            row.append(previous[j] + 1 if item == seen else max(previous[j + 1], row[j]))
        previous = row
    return previous[-1]
