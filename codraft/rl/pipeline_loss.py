"""The joint loss on the last pipeline stage, one microbatch at a time, normalised to the whole batch.

Each microbatch contributes w_rl * L_RL(mb) + lambda * w_draft * L_draft(mb), with weights from counts over
the whole batch, so the sum over microbatches is the loss of one forward over the whole batch (pp = 1):
  token-mean:    w_rl = response tokens of mb / response tokens of the batch
  sequence-mean: w_rl = sequences with a response token in mb / those in the batch
  dr-grpo:       w_rl = sequences in mb / sequences in the batch (the denominator B * max_tokens is linear in B)
  draft:         w_draft = response tokens of mb / those of the batch. Exact for a draft loss that is one mean
                 over response tokens (EAGLE-3 with the full draft vocab and prompts longer than its TTT steps);
                 DFlash/DSpark sample anchors per sequence, so their split loss matches only in expectation.
"""

from __future__ import annotations

from collections import defaultdict

import torch

from codraft.config import RLConfig
from codraft.drafts import DraftModel
from codraft.rl.batch import per_sequence
from codraft.rl.grpo import grpo_loss_for
from codraft.rl.microbatch import Microbatch


def rl_weights(microbatches: list[Microbatch], aggregation: str) -> list[float]:
    if aggregation == "token-mean":
        counts = [float(mb.batch.response_mask.sum()) for mb in microbatches]
    elif aggregation == "sequence-mean":
        counts = [float((mb.batch.response_lengths() > 0).sum()) for mb in microbatches]
    else:  # dr-grpo
        counts = [float(mb.batch.num_sequences) for mb in microbatches]
    return [c / max(sum(counts), 1.0) for c in counts]


class JointObjective:
    """Callable objective of the last stage (see `codraft.parallel.pipeline.Objective`); accumulates metrics.

    The ratio's old log-probs are the first pass's own (detached), as in the pp = 1 trainer: kept per
    microbatch for the later optimizer steps on the same batch."""

    def __init__(self, rl: RLConfig, draft: DraftModel | None, microbatches: list[Microbatch]):
        self.rl, self.draft, self.microbatches = rl, draft, microbatches
        self.w_rl = rl_weights(microbatches, rl.aggregation)
        self.w_draft = rl_weights(microbatches, "token-mean")
        self.old_lp: dict[int, torch.Tensor] = {}
        self.metrics: dict[str, float] = defaultdict(float)
        self.finite = True  # the RL loss of every microbatch so far
        self.skipped_draft = 0

    def reset_metrics(self) -> None:
        self.metrics, self.finite, self.skipped_draft = defaultdict(float), True, 0

    def __call__(self, m: int, logits: torch.Tensor, taps: dict[int, torch.Tensor]) -> torch.Tensor:
        """logits [tokens, V] of microbatch m's view (unpadded), taps {layer: [tokens, H]} detached -> scalar."""
        loss = self.w_rl[m] * self._rl_loss(m, logits)
        if self.draft is not None and self.rl.draft_weight > 0:
            loss = loss + self.rl.draft_weight * self.w_draft[m] * self._draft_loss(m, logits, taps)
        self.metrics["entropy"] += self.w_draft[m] * float(self.microbatches[m].view.response_entropy(
            logits.detach(), self.rl.temperature))
        return loss

    def _rl_loss(self, m: int, logits: torch.Tensor) -> torch.Tensor:
        rl, mb = self.rl, self.microbatches[m]
        logprobs, mask = per_sequence(mb.view.response_logprobs(logits, rl.temperature), mb.batch)
        old = self.old_lp.setdefault(m, logprobs.detach())
        inference_lp, _ = per_sequence(mb.batch.inference_logprobs, mb.batch)
        loss, metrics = grpo_loss_for(rl, logprobs, old, mb.advantages, mask, inference_lp)
        self._accumulate(metrics, self.w_rl[m])
        if not torch.isfinite(loss):
            self.finite = False
            return loss.detach().nan_to_num(0.0)  # no gradient; the step is skipped after the pipeline
        return loss

    def _draft_loss(self, m: int, logits: torch.Tensor, taps: dict[int, torch.Tensor]) -> torch.Tensor:
        loss, metrics = self.draft.loss(self.microbatches[m].view.draft_batch(taps, logits))
        if not torch.isfinite(loss):  # a broken draft may cost acceptance, never the policy
            self.skipped_draft += 1
            return loss.new_zeros(())
        self._accumulate(metrics, self.w_draft[m])
        return loss

    def _accumulate(self, metrics: dict[str, float], weight: float) -> None:
        for k, v in metrics.items():
            self.metrics[k] += weight * v

