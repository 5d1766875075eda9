"""How likely a draft token is to be accepted, from the draft's own confidence.

A row's i-th draft is kept only if it and every draft before it are accepted. The product of the draft's
probabilities of those tokens (its cumulative confidence) ranks them well, but is no probability of
acceptance: drafts with cumulative confidence 0.1-0.2 were accepted 14% of the time at T=0 and 30% at T=1,
where a token the draft found unlikely can still pass p/q (the default arithmetic EAGLE-3 warm start, batch 8,
k=4). So the acceptance of each confidence bucket is learned from the verify steps, starting from the
confidence itself.

Only verified drafts are observed: the controller verifies every draft now and then, so the buckets it
truncates keep being measured; a chain draft that stops early (`DraftStop`) has its last, least confident draft
verified, which keeps the buckets below its threshold measured.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

EDGES = (0.02, 0.05, 0.1, 0.2, 0.3, 0.5, 0.7, 0.9)  # upper edges of the cumulative-confidence buckets
PRIOR = (0.01, 0.035, 0.075, 0.15, 0.25, 0.4, 0.6, 0.8, 0.95)  # each bucket's confidence: the prior estimate


class DraftCalibration:
    """P(draft i of a row is accepted, with all before it) per bucket of its cumulative confidence."""

    def __init__(self, prior_weight: float = 2.0, memory: float = 64.0):
        self.edges = torch.tensor(EDGES)
        self.prior = torch.tensor(PRIOR, dtype=torch.float64)
        self.prior_weight, self.memory = prior_weight, memory  # each bucket averages ~ its last `memory` drafts
        self.hits = torch.zeros(len(PRIOR), dtype=torch.float64)
        self.trials = torch.zeros(len(PRIOR), dtype=torch.float64)

    def table(self) -> torch.Tensor:
        """The estimate per bucket, made non-decreasing in confidence: a noisy low bucket must not keep a
        draft that a more confident one would drop."""
        estimate = (self.hits + self.prior_weight * self.prior) / (self.trials + self.prior_weight)
        return estimate.cummax(0).values

    def __call__(self, confidence: torch.Tensor) -> torch.Tensor:
        """confidence [B, k] (each draft's own probability) -> estimated acceptance of each draft with those
        before it [B, k]."""
        return self.lookup(confidence.float().cumprod(-1), self.table())

    def lookup(self, cumulative: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        """`table`'s (a `table()` read earlier) estimate at each cumulative confidence."""
        return table.to(cumulative.device)[self.bucket(cumulative)]

    def bucket(self, cumulative: torch.Tensor) -> torch.Tensor:
        """The bucket of each cumulative confidence (an index into `table()`)."""
        return torch.bucketize(cumulative, self.edges.to(cumulative.device))

    def observe(self, confidence: torch.Tensor, verified: torch.Tensor, accepted: torch.Tensor) -> None:
        """confidence [B, k]; the first verified[b] drafts of row b were verified and accepted[b] accepted."""
        steps = torch.arange(confidence.shape[1], device=confidence.device)
        seen = steps < verified[:, None]
        buckets = self.bucket(confidence.float().cumprod(-1)[seen]).cpu()
        kept = (steps < accepted[:, None])[seen].double().cpu()
        trials = torch.bincount(buckets, minlength=len(PRIOR)).double()
        hits = torch.bincount(buckets, weights=kept, minlength=len(PRIOR))
        fade = (self.memory / (self.trials + trials).clamp(min=1e-9)).clamp(max=1.0)
        self.hits, self.trials = fade * (self.hits + hits), fade * (self.trials + trials)


@dataclass
class DraftStop:
    """When a chain draft (one token per draft forward, EAGLE-3) ends its proposal: after its i-th token, once the
    rows together are expected to accept fewer than `min_accepted` of their (i+1)-th drafts (each with all before
    it): a draft forward for the batch and a verified token per row, paid whether accepted or not. The (i+1)-th
    draft's confidence is not known before its forward, so it is taken to be the i-th's (confidence runs in
    stretches: a copied number, then a choice). Chosen by an offline estimate (a batch-1 trace of the EAGLE-3 warm
    start at fixed k = 7, re-priced with per-token costs from timings; not a run): 1.48x plain decoding at T=0
    against 1.35x for the best fixed k, and the i-th draft's own acceptance as the rule (no look-ahead) 1.40x,
    drafting too long. Measured in process the gain was smaller (README, stop 40)."""

    calibration: DraftCalibration
    min_accepted: float  # drafts accepted, summed over the rows, that pay for one more draft position
    # seconds between consecutive calls: each is one draft position's forward (and this rule), the marginal cost of
    # drafting deeper, where a proposal's whole time also holds absorbing the committed tokens
    position_s: list[float] = field(default_factory=list)
    last_call: float | None = None
    table: torch.Tensor = field(init=False)  # the calibration's, read once: nothing is observed while a proposal drafts

    def __post_init__(self):
        self.table = self.calibration.table()

    def __call__(self, confidence: torch.Tensor) -> bool:
        """confidence [B, i]: the draft's probability of each of its i tokens so far."""
        now = time.perf_counter()
        if self.last_call is not None:
            self.position_s.append(now - self.last_call)
        self.last_call = now
        ahead = confidence.float().prod(-1) * confidence[:, -1]  # the next draft's cumulative confidence [B]
        return float(self.calibration.lookup(ahead, self.table).sum()) < self.min_accepted
