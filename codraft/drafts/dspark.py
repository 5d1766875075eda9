"""DSpark: DFlash plus a low-rank first-order Markov head, trained on a CE + TV mix.

The logits of slot k get the bias W2(W1[x_{k-1}]) from the token before it (the
anchor for slot 1): W1 an Embedding(V, r), W2 a Linear(r, V). Training feeds the
rollout tokens (teacher forcing); inference samples the slots left to right, each
from its distribution given the token just drafted before it, and reports that
conditional distribution as q, so verification stays lossless. W2 starts at zero:
a fresh DSpark drafts exactly as its DFlash backbone.

Loss per slot: ce_weight * CE (draft.loss: soft_ce or hard_ce) + tv_weight * TV,
where TV = 1 - the expected acceptance of the slot's draft.

Optional confidence head (draft.confidence_head): a Linear(H, 1) on each slot's
hidden state, trained with BCE against the slot's detached expected acceptance
sum_v min(p, q) (a soft target in [0, 1]: the chance that speculative sampling at
T=1 accepts the slot's draft given its prefix was accepted; it keeps the signal the
0/1 argmax agreement throws away). It reads the hidden state detached, so it
predicts the drafter's confidence without changing the drafter.
"""

from __future__ import annotations

from dataclasses import replace
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from codraft.config import DraftConfig
from codraft.drafts.dflash import DFlashDraft
from codraft.drafts.export import register_family
from codraft.drafts.losses import draft_loss, expected_acceptance, weighted_mean
from codraft.drafts.vocab import HeadRows
from codraft.models import ModelArgs
from codraft.rollout.sampling import SamplingParams, draw_proposal


class MarkovHead(nn.Module):
    """prev token [...] -> logit bias [..., V] = W2(W1[prev]), rank r."""

    def __init__(self, vocab_size: int, rank: int):
        super().__init__()
        self.w1 = nn.Embedding(vocab_size, rank)
        self.w2 = nn.Linear(rank, vocab_size, bias=False)
        nn.init.zeros_(self.w2.weight)

    def forward(self, prev: torch.Tensor) -> torch.Tensor:
        return self.w2(self.w1(prev))


class DSparkDraft(DFlashDraft):
    family = "dspark"
    architecture = "DSparkDraftModel"

    def __init__(self, cfg: DraftConfig, policy_args: ModelArgs, **kwargs):
        super().__init__(cfg, policy_args, **kwargs)
        self.markov = MarkovHead(policy_args.vocab_size, cfg.markov_rank)
        self.confidence = nn.Linear(policy_args.hidden_size, 1) if cfg.confidence_head else None
        self.rows["markov"] = HeadRows()

    def slot_logits(self, hidden: torch.Tensor, prev_tokens: torch.Tensor) -> torch.Tensor:
        return self.policy_head(hidden) + self.markov(prev_tokens)

    def draft_block(
        self, hidden: torch.Tensor, first: torch.Tensor, params: SamplingParams, generator: torch.Generator | None
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """Left to right: slot k is drawn given the token drafted at slot k-1 (the policy head runs once for all
        slots; only the Markov bias waits for the previous token)."""
        base = self.head_logits(hidden)  # [B, n, N]
        tokens, probs, confidence, prev = [], [], [], first
        for k in range(hidden.shape[1]):
            local, p, c = draw_proposal(base[:, k] + self.markov_logits(prev), params, generator)  # [B], [B, N] | None
            prev = self.target_ids(local)
            tokens.append(prev)
            probs.append(p)
            confidence.append(c)
        return torch.stack(tokens, 1), None if params.greedy else torch.stack(probs, 1), torch.stack(confidence, 1)

    def markov_logits(self, prev: torch.Tensor) -> torch.Tensor:
        """Inference: the Markov bias [..., N] over `head_vocab` (all V without one)."""
        if self.head_vocab is None:
            return self.markov(prev)
        return self.rows["markov"](self.markov.w2.weight, self.head_vocab, self.inference_dtype)(self.markov.w1(prev))

    def block_loss(self, hidden, logits, policy_logits, targets, weights, total):
        flat = logits.flatten(0, 1), policy_logits.flatten(0, 1), targets.flatten()
        ce, tv = draft_loss(*flat, self.cfg.loss), draft_loss(*flat, "tv")
        w = weights.flatten()
        mean = partial(weighted_mean, weights=w, total=total, weight_sum=total(w.sum()))
        loss = mean(self.cfg.ce_weight * ce + self.cfg.tv_weight * tv)
        with torch.no_grad():
            metrics = {"loss/draft_ce": mean(ce).item(), "loss/draft_tv": mean(tv).item()}
        if self.confidence is not None:
            target = expected_acceptance(*flat[:2])  # [G*(b-1)], no grad
            score = self.confidence(hidden.detach()).flatten().float()
            bce = mean(F.binary_cross_entropy_with_logits(score, target, reduction="none"))
            loss = loss + bce
            metrics["loss/draft_confidence"] = bce.item()
        return loss, metrics

    def export_config(self) -> dict:
        return {
            **super().export_config(),
            "markov_rank": self.cfg.markov_rank,
            "confidence_head": self.cfg.confidence_head,
        }

    @classmethod
    def config_from_export(cls, config: dict) -> DraftConfig:
        cfg = super().config_from_export(config)
        return replace(cfg, markov_rank=config["markov_rank"], confidence_head=config.get("confidence_head", False))


register_family(DSparkDraft.family, DSparkDraft, (DSparkDraft.architecture,))
