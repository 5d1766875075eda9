"""Per-position draft losses against the detached policy.

soft_ce: -sum_v p(v) log q(v), the policy distribution as soft target (default).
hard_ce: -log q(x), the rollout token as target.
tv:      1/2 sum_v |p(v) - q(v)| = 1 - sum_v min(p, q), i.e. one minus the
         expected acceptance rate of a draft token under speculative sampling,
         so minimising it targets acceptance directly.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from codraft.config import DraftLoss


def draft_loss(
    draft_logits: torch.Tensor,  # [N, V]
    policy_logits: torch.Tensor,  # [N, V], same vocab as the draft (already restricted), detached
    target_tokens: torch.Tensor,  # [N] ids in the draft vocab (for hard_ce; ignored otherwise)
    kind: DraftLoss,
) -> torch.Tensor:
    """Loss per position [N], fp32."""
    log_q = F.log_softmax(draft_logits.float(), dim=-1)
    if kind == "hard_ce":
        return -log_q.gather(-1, target_tokens[:, None]).squeeze(-1)
    p = F.softmax(policy_logits.float(), dim=-1)
    if kind == "soft_ce":
        return -(p * log_q).sum(-1)
    if kind == "tv":
        return 0.5 * (p - log_q.exp()).abs().sum(-1)
    raise ValueError(f"draft.loss must be one of soft_ce, hard_ce, tv; got {kind!r}")


@torch.no_grad()
def expected_acceptance(draft_logits: torch.Tensor, policy_logits: torch.Tensor) -> torch.Tensor:
    """sum_v min(p, q) per position [N]: the chance speculative sampling accepts a draft token (T=1)."""
    return torch.minimum(F.softmax(draft_logits.float(), -1), F.softmax(policy_logits.float(), -1)).sum(-1)


def weighted_mean(
    per_position: torch.Tensor,
    weights: torch.Tensor,
    total: Callable[[torch.Tensor], torch.Tensor] = lambda x: x,
    weight_sum: torch.Tensor | None = None,
) -> torch.Tensor:
    """sum(w * l) / sum(w), 0 when no weight (an all-masked batch must not produce NaN). `total` sums
    both over the ranks that hold parts of the batch (TokenShard.total), so every rank gets the whole
    batch's mean; `weight_sum` = total(weights.sum()), when several means share the weights."""
    weight_sum = total(weights.sum()) if weight_sum is None else weight_sum
    return total((per_position * weights).sum()) / weight_sum.clamp(min=1e-9)
