"""SPEC-RL's idea kept lossless: propose the policy's previous rollout for the same prompt.

The previous completion is verified as a point mass, so reusing it can only
save target forwards, never change what the current policy samples. While the
new output still agrees with the old one the old continuation is proposed
as-is; after they diverge, the old completion is searched for the row's latest
n-gram, which re-synchronises on shared phrases.
"""

from __future__ import annotations

import torch

from codraft.rollout.drafters.ngram import NgramDrafter, lookup
from codraft.rollout.sampling import SamplingParams


class PreviousRolloutDrafter(NgramDrafter):
    def __init__(self, max_ngram: int = 4, min_ngram: int = 2):
        super().__init__(max_ngram, min_ngram)
        self.memory: dict[tuple[int, ...], list[int]] = {}
        self.previous: list[list[int]] = []
        self.prompt_lens: list[int] = []

    def remember(self, prompts: list[list[int]], completions: list[list[int]]) -> None:
        """Store this step's completions; with several per prompt the last one is kept."""
        for prompt, completion in zip(prompts, completions, strict=True):
            self.memory[tuple(prompt)] = list(completion)

    def start(
        self, prompts: list[list[int]], taps: dict[int, torch.Tensor], params: SamplingParams, max_len: int,
        generator: torch.Generator | None = None,
    ) -> None:
        super().start(prompts, taps, params, max_len, generator)
        self.previous = [self.memory.get(tuple(p), []) for p in prompts]
        self.prompt_lens = [len(p) for p in prompts]

    def continuation(self, row: int, history: list[int], k: int) -> list[int]:
        old = self.previous[row]
        done = history[self.prompt_lens[row] :]
        if old[: len(done)] == done:  # still on the old path
            return old[len(done) : len(done) + k]
        return lookup(history, old, k, self.max_ngram, self.min_ngram)

    def keep_rows(self, rows: torch.Tensor) -> None:
        super().keep_rows(rows)
        keep = rows.tolist()
        self.previous = [self.previous[i] for i in keep]
        self.prompt_lens = [self.prompt_lens[i] for i in keep]
