"""The joint objective, one microbatch at a time: L = w_rl * L_RL(mb) + lambda * w_draft * L_draft(mb).

The one loss of every layout: at pp = 1 the whole batch is one microbatch of weight 1; under PP the last
stage calls it once per microbatch inside the pipeline schedule. Weights come from counts over the whole
batch of every data-parallel replica, so the sum over microbatches (and replicas) is the loss of one forward
over all of it:
  token-mean:    w_rl = response tokens of mb / response tokens of the batch
  sequence-mean: w_rl = sequences with a response token in mb / those in the batch
  dr-grpo:       w_rl = sequences in mb / sequences in the batch (the denominator B * max_tokens is linear in B)
  draft:         w_draft = response tokens of mb / those of the batch. Exact for a draft loss that is one mean
                 over response tokens (EAGLE-3 with the full draft vocab and prompts longer than its TTT steps);
                 DFlash/DSpark sample anchors per sequence, so their split loss matches only in expectation.

Rules, the same everywhere: a non-finite RL loss contributes nothing and the step is skipped after the
backward (`finite`); a non-finite draft loss is left out of the draft update (`skipped_draft`), never the
policy's; the ratio's old log-probs are the first pass's own (detached), kept per microbatch for the later
optimizer steps on the same batch; with rl.beta > 0 the frozen reference's log-probs of the same tokens
(train/reference.py: no gradient, computed once per update before the forward/backward) enter the k3 KL term
(metric kl/ref); the draft's loss runs its matmuls under `rl.draft_matmul_dtype` (models/autocast.py), the RL
loss never. Given a `frozen_draft` (the run's initial draft, never updated: rl.frozen_draft_every), its loss
metrics on the same draft batch are logged beside the trained draft's as frozen_draft/*, without gradient: the
two drafts scored on the same tokens of the same policy. `seconds` adds up the update's wall-clock time on the draft
(its term's forward here; the trainer adds its backward, clip and optimizer step) and on the control's scoring: the
step's time accounting (trainer.py: time/draft_train_s, time/frozen_draft_s).
"""

from __future__ import annotations

from collections import defaultdict

import torch

from codraft.config import RLConfig
from codraft.drafts import DraftModel
from codraft.models.autocast import training_autocast
from codraft.observability import timed
from codraft.parallel.collectives import sum_over_replicas
from codraft.parallel.mesh import ParallelDims
from codraft.rl.batch import Microbatch, per_sequence
from codraft.rl.grpo import grpo_loss_for


def rl_weights(microbatches: list[Microbatch], aggregation: str, dims: ParallelDims | None = None) -> list[float]:
    """Each microbatch's share of the batch of all replicas (collective over the dp group)."""
    if aggregation == "token-mean":
        counts = [float(mb.batch.response_mask.sum()) for mb in microbatches]
    elif aggregation == "sequence-mean":
        counts = [float((mb.batch.response_lengths() > 0).sum()) for mb in microbatches]
    else:  # dr-grpo
        counts = [float(mb.batch.num_sequences) for mb in microbatches]
    total = sum(counts) if dims is None else float(sum_over_replicas(torch.tensor(sum(counts)), dims))
    return [c / max(total, 1.0) for c in counts]


class JointObjective:
    """objective(m, logits, taps) -> microbatch m's share of the step's loss; accumulates metrics."""

    def __init__(self, rl: RLConfig, draft: DraftModel | None, microbatches: list[Microbatch],
                 dims: ParallelDims | None = None, ref_logprobs: list[torch.Tensor] | None = None,
                 frozen_draft: DraftModel | None = None):
        """`ref_logprobs`: [N, Lmax] per microbatch, the reference's (reference_logprobs); needed at rl.beta > 0.
        `frozen_draft`: a draft scored beside `draft` on the same batches (metrics only)."""
        assert rl.beta == 0 or ref_logprobs is not None, "rl.beta > 0 needs the reference's log-probs"
        self.rl, self.draft, self.microbatches, self.ref_lp = rl, draft, microbatches, ref_logprobs
        self.frozen_draft = frozen_draft
        self.w_rl = rl_weights(microbatches, rl.aggregation, dims)
        self.w_draft = rl_weights(microbatches, "token-mean", dims)
        self.old_lp: dict[int, torch.Tensor] = {}
        self.seconds = {"draft": 0.0, "frozen_draft": 0.0}  # over the whole update (module docstring)
        self.reset_metrics()

    def reset_metrics(self) -> None:
        self.metrics: dict[str, float] = defaultdict(float)
        self.finite = True  # the RL loss of every microbatch so far
        self.skipped_draft = 0

    def __call__(self, m: int, logits: torch.Tensor, taps: dict[int, torch.Tensor]) -> torch.Tensor:
        """logits [tokens, V] of microbatch m's view (unpadded), taps {layer: [tokens, H]} detached -> scalar."""
        rl_term, draft_term = self.terms(m, logits, taps)
        return rl_term if draft_term is None else rl_term + draft_term

    def terms(self, m: int, logits: torch.Tensor, taps: dict[int, torch.Tensor]
              ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Microbatch m's RL term and draft term (None without a trained draft), which sum to its loss. Their
        graphs share nothing (the draft reads detached taps and logits), so each may run its own backward."""
        rl_term = self.w_rl[m] * self._rl_loss(m, logits)
        draft_term = None
        if self.draft is not None and self.rl.draft_weight > 0:
            draft_term = self.rl.draft_weight * self.w_draft[m] * self._draft_loss(m, logits, taps)
        self.metrics["entropy"] += self.w_draft[m] * float(self.microbatches[m].view.response_entropy(
            logits.detach(), self.rl.temperature))
        return rl_term, draft_term

    def _rl_loss(self, m: int, logits: torch.Tensor) -> torch.Tensor:
        rl, mb = self.rl, self.microbatches[m]
        logprobs, mask = per_sequence(mb.view.response_logprobs(logits, rl.temperature), mb.batch)
        old = self.old_lp.setdefault(m, logprobs.detach())
        ref = self.ref_lp[m] if rl.beta > 0 else None
        inference_lp, _ = per_sequence(mb.batch.inference_logprobs, mb.batch)
        loss, metrics = grpo_loss_for(rl, logprobs, old, mb.advantages, mask, inference_lp, ref)
        self._accumulate(metrics, self.w_rl[m])
        if not torch.isfinite(loss):
            self.finite = False
            return loss.detach().nan_to_num(0.0)  # no gradient; the step is skipped after the backward
        return loss

    def _draft_loss(self, m: int, logits: torch.Tensor, taps: dict[int, torch.Tensor]) -> torch.Tensor:
        batch = self.microbatches[m].view.draft_batch(taps, logits)
        frozen = {}
        if self.frozen_draft is not None:  # first, on a forked RNG: both drafts draw the same anchors (DFlash,
            # DSpark) and the trained draft's stream is what it is without the frozen one. Not under no_grad: it
            # would switch the borrowed policy head to its packed inference copy (DraftModel.policy_head), another
            # precision than the trained draft's; nothing here requires grad, so no graph is built.
            cuda = [logits.device] if logits.device.type == "cuda" else []
            with (timed(self.seconds, "frozen_draft"), torch.random.fork_rng(devices=cuda),
                  training_autocast(self.frozen_draft, self.rl.draft_matmul_dtype)):
                _, frozen = self.frozen_draft.loss(batch)
        with timed(self.seconds, "draft"), training_autocast(self.draft, self.rl.draft_matmul_dtype):
            loss, metrics = self.draft.loss(batch)
        if not torch.isfinite(loss):  # a broken draft may cost acceptance, never the policy
            self.skipped_draft += 1
            return loss.new_zeros(())
        # the pair is logged only where the trained draft's metrics are: both over the same microbatches
        self._accumulate(metrics | {frozen_name(k): v for k, v in frozen.items()}, self.w_draft[m])
        return loss

    def _accumulate(self, metrics: dict[str, float], weight: float) -> None:
        for k, v in metrics.items():
            self.metrics[k] += weight * v


def frozen_name(metric: str) -> str:
    """A draft loss metric's name for the frozen draft: draft/x -> frozen_draft/x, loss/draft[_y] ->
    frozen_draft/loss[_y]."""
    if metric.startswith("loss/draft"):
        return "frozen_draft/loss" + metric.removeprefix("loss/draft")
    return "frozen_draft/" + metric.removeprefix("draft/")
