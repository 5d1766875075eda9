"""Prompt lookup: propose what followed the latest earlier occurrence of the last n tokens."""

from __future__ import annotations

import torch

from codraft.rollout.drafter import Drafter, Proposal
from codraft.rollout.sampling import SamplingParams


def lookup(history: list[int], corpus: list[int], k: int, max_ngram: int, min_ngram: int) -> list[int]:
    """Up to k tokens that followed the longest suffix of `history` (>= min_ngram) found in `corpus`.

    When `corpus` is `history` itself, the suffix's own occurrence is not a match.
    """
    own = corpus is history
    for n in range(min(max_ngram, len(history)), min_ngram - 1, -1):
        suffix = history[-n:]
        last_start = len(corpus) - n - (1 if own else 0)
        for start in range(last_start, -1, -1):  # latest match first: recent text predicts best
            if corpus[start : start + n] == suffix:
                follow = corpus[start + n : start + n + k]
                if follow:
                    return follow
    return []


class NgramDrafter(Drafter):
    """Point-mass proposals from each row's own prompt and output so far."""

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.histories: list[list[int]] = []

    def start(
        self, prompts: list[list[int]], taps: dict[int, torch.Tensor], params: SamplingParams, max_len: int,
        generator: torch.Generator | None = None,
    ) -> None:
        self.histories = [list(p) for p in prompts]

    def continuation(self, row: int, history: list[int], k: int) -> list[int]:
        """Up to k proposed tokens for `row`, whose tokens so far are `history`."""
        return lookup(history, history, k, self.max_ngram, self.min_ngram)

    def propose(self, pending: torch.Tensor, k: int, probe_rows: int | None = None, stop: None = None) -> Proposal:
        tokens = torch.zeros(len(self.histories), k, dtype=torch.long)
        lengths = torch.zeros(len(self.histories), dtype=torch.long)
        for row, last in enumerate(pending.tolist()):
            follow = self.continuation(row, self.histories[row] + [last], k)
            tokens[row, : len(follow)] = torch.tensor(follow, dtype=torch.long)
            lengths[row] = len(follow)
        return Proposal(tokens=tokens.to(pending.device), lengths=lengths.to(pending.device))

    def commit(self, tokens: torch.Tensor, kept: torch.Tensor, taps: dict[int, torch.Tensor]) -> None:
        for row, (fed, n) in enumerate(zip(tokens.tolist(), kept.tolist(), strict=True)):
            self.histories[row].extend(fed[:n])

    def keep_rows(self, rows: torch.Tensor) -> None:
        self.histories = [self.histories[i] for i in rows.tolist()]
