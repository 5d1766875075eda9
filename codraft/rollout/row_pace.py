"""How each row still decoding accepts drafts, against what the controller's estimate expected of it.

The controller's acceptance estimate averages the batch's recent row observations, and a batch's rows are not
alike: one copies a long list, another is past its answer. With known lengths (stop tokens off) the rows that
accept well finish first and the call lasts as long as its slowest row: a batch of 4 on held-out lists (T=0, 48
tokens) kept drafting 7 tokens for its last row, which accepted a draft in ten, for the 15-24 steps after its
three others were done, and that call ran 0.88x plain decoding. So each row's accepted drafts are kept against
the drafts the estimate expected of it at each of its verified steps, over about its last `memory` such steps and
shrunk to "as expected" by `prior` expected drafts; the controller prices a call with each row at its own pace
(`SpeculationController.call_seconds`).
"""

from __future__ import annotations

import torch


class RowPace:
    # over ~8 steps, shrunk by 4 expected drafts, a row that accepted nothing still read a quarter of the expected
    # drafts: lists at batch 4, T=0 ran 0.982x plain decoding against 0.987x with these, where the chain task at
    # batch 4, T=1 ran 1.119x against 1.172x (the rows' mean 0.937x and 1.182x; one in-process A/B of 5 rounds each)
    def __init__(self, memory: float = 16.0, prior: float = 2.0):
        self.memory, self.prior = memory, prior
        self.accepted = torch.zeros(0, dtype=torch.float64)  # live rows' drafts accepted, decayed
        self.expected = torch.zeros(0, dtype=torch.float64)  # what the estimate expected of them at those steps
        self.steps = torch.zeros(0, dtype=torch.float64)  # their verified steps, decayed alike
        self._ratios: list[float] | None = None  # `ratios()` until the next change (read for each k priced)
        self.batch = 0  # the rows the call started with

    def start(self, rows: int) -> None:
        """A call of `rows` rows starts."""
        self.accepted = torch.zeros(rows, dtype=torch.float64)
        self.expected = torch.zeros(rows, dtype=torch.float64)
        self.steps = torch.zeros(rows, dtype=torch.float64)
        self._ratios, self.batch = None, rows

    def rows(self) -> int:
        return len(self.steps)

    def ratios(self) -> list[float]:
        """Each live row's accepted drafts over the expected ones, shrunk to 1 (1 for a row never verified)."""
        if self._ratios is None:
            self._ratios = ((self.accepted + self.prior) / (self.expected + self.prior)).tolist()
        return self._ratios

    def observe(self, verified: torch.Tensor, accepted: torch.Tensor, expected: float) -> None:
        """A speculative step: verified [B] (the row had drafts verified), accepted [B] drafts each, and the
        accepted drafts the estimate expected of a verified row."""
        if len(verified) != self.rows():
            return  # a controller driven without a call's start tracks no rows
        seen = verified.cpu()
        fade = torch.clamp(self.memory / (self.steps + 1), max=1.0)
        self.accepted = torch.where(seen, fade * (self.accepted + accepted.cpu()), self.accepted)
        self.expected = torch.where(seen, fade * (self.expected + expected), self.expected)
        self.steps = torch.where(seen, fade * (self.steps + 1), self.steps)
        self._ratios = None

    def keep(self, keep: torch.Tensor) -> None:
        """Only rows `keep` (indices into the live rows) go on, in that order (the engine's compaction)."""
        if self.rows():
            keep = keep.cpu()
            self.accepted, self.expected, self.steps = self.accepted[keep], self.expected[keep], self.steps[keep]
            self._ratios = None
