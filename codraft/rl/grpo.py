"""GRPO: group-normalised advantages and the clipped policy-gradient loss, with train/inference IS correction.

Conventions follow TRL's GRPOTrainer and NeMo-RL's ClippedPGLossFn so that their users read the knobs the
same way: ratio = exp(logprobs - old_logprobs), PPO clipping with separate low/high epsilons (DAPO's
clip-higher), k3 KL to a reference policy, and truncated importance sampling between the log-probs the
rollout engine recorded and the trainer's own (the train/inference mismatch fix of verl / NeMo-RL).
All maths in fp32; masked positions never reach a sum (torch.where, so padding may hold inf/nan).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch
from torch import Tensor

from codraft.config import RLConfig

Aggregation = Literal["token-mean", "sequence-mean", "dr-grpo"]
ISCorrection = Literal["none", "tis", "token-clip"]
AGGREGATIONS = ("token-mean", "sequence-mean", "dr-grpo")
IS_CORRECTIONS = ("none", "tis", "token-clip")


def masked_mean(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean of `x` over positions where `mask` is true (0 where there are none)."""
    mask = mask.bool()
    total = torch.where(mask, x, 0.0).sum() if dim is None else torch.where(mask, x, 0.0).sum(dim)
    count = mask.sum() if dim is None else mask.sum(dim)
    return total / count.clamp(min=1)


def rewards_tensor(rewards: Sequence[float | None] | Tensor) -> Tensor:
    """fp32 rewards [N] with dropped samples (None) as NaN."""
    if isinstance(rewards, Tensor):
        return rewards.float()
    return torch.tensor([float("nan") if r is None else float(r) for r in rewards], dtype=torch.float32)


def _groups(rewards: Sequence[float | None] | Tensor, group_size: int) -> Tensor:
    r = rewards_tensor(rewards)
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    if r.ndim != 1 or r.numel() % group_size:
        raise ValueError(f"rewards must be 1-D with a length divisible by group_size={group_size}, "
                         f"got shape {tuple(r.shape)}")
    return r.view(-1, group_size)  # [G, group_size]


def group_advantages(rewards: Sequence[float | None] | Tensor, group_size: int, scale_by_std: bool = True,
                     eps: float = 1e-6) -> Tensor:
    """(r - group mean) / (group std + eps), or r - group mean when `scale_by_std` is False (Dr. GRPO).

    `rewards` [N] lists the group_size samples of each prompt consecutively. The std is the unbiased
    sample std (correction=1), as TRL's `rewards.view(-1, G).std(dim=1)`; TRL adds 1e-4, we add `eps`.
    Dropped samples (None / NaN) get advantage 0 and are left out of their group's mean and std.
    A zero-variance group (see `zero_variance_groups`) gets advantage exactly 0. Returns fp32 [N].
    """
    g = _groups(rewards, group_size)
    valid = ~torch.isnan(g)
    n = valid.sum(1, keepdim=True)  # [G, 1]
    mean = torch.where(valid, g, 0.0).sum(1, keepdim=True) / n.clamp(min=1)
    centered = torch.where(valid, g - mean, 0.0)  # [G, group_size]
    if scale_by_std:
        std = (centered.square().sum(1, keepdim=True) / (n - 1).clamp(min=1)).sqrt()
        centered = centered / (std + eps)
    # exactly 0 where the group is flat: rounding in the mean must not become a +-1 advantage after / std
    centered = torch.where(_flat(g)[:, None], 0.0, centered)
    return centered.reshape(-1)


def _flat(g: Tensor, atol: float = 1e-6) -> Tensor:
    """Bool [G]: fewer than 2 valid rewards, or all valid rewards within `atol` of each other."""
    valid = ~torch.isnan(g)
    high = torch.where(valid, g, -torch.inf).amax(1)
    low = torch.where(valid, g, torch.inf).amin(1)
    return (valid.sum(1) < 2) | (high - low <= atol)


def zero_variance_groups(rewards: Sequence[float | None] | Tensor, group_size: int, atol: float = 1e-6) -> Tensor:
    """Bool [N]: the sample's group has (near) identical valid rewards, hence no learning signal (DAPO filter)."""
    return _flat(_groups(rewards, group_size), atol).repeat_interleave(group_size)


def _aggregate(per_token: Tensor, mask: Tensor, aggregation: str, max_tokens: int) -> Tensor:
    per_token = torch.where(mask, per_token, 0.0)  # [B, T]
    if aggregation == "token-mean":
        return per_token.sum() / mask.sum().clamp(min=1)
    if aggregation == "sequence-mean":
        per_seq = per_token.sum(1) / mask.sum(1).clamp(min=1)  # [B]; sequences without tokens add 0
        return per_seq.sum() / mask.any(1).sum().clamp(min=1)
    return per_token.sum() / (per_token.shape[0] * max_tokens)  # dr-grpo


def _k3(log_ratio: Tensor) -> Tensor:
    """Schulman's k3 estimator of KL(p || q) from log(q/p) at samples of p: exp(x) - x - 1 >= 0."""
    return log_ratio.exp() - log_ratio - 1


def grpo_loss(
    logprobs: Tensor,  # [B, T] current policy, carries the gradient
    old_logprobs: Tensor,  # [B, T] policy that the ratio is taken against (trainer-side, no grad)
    advantages: Tensor,  # [B]
    mask: Tensor,  # [B, T] true on completion tokens
    *,
    eps_low: float = 0.2,
    eps_high: float = 0.2,
    beta: float = 0.0,
    ref_logprobs: Tensor | None = None,  # [B, T], needed when beta > 0
    aggregation: Aggregation = "token-mean",
    max_tokens: int | None = None,
    inference_logprobs: Tensor | None = None,  # [B, T] recorded by the rollout engine
    is_correction: ISCorrection = "none",
    is_cap: float = 2.0,
) -> tuple[Tensor, dict[str, float]]:
    """Clipped GRPO loss (scalar, fp32) and float metrics.

    per token:  -min(r A, clip(r, 1 - eps_low, 1 + eps_high) A) * w  +  beta * k3(ref, logprobs)
      r = exp(logprobs - old_logprobs)
      w = IS weight from x = old_logprobs - inference_logprobs (detached; multiplies the policy term only,
          as in NeMo-RL):
          "none": 1;  "tis": min(exp(x), is_cap);  "token-clip": exp(x) inside [1/is_cap, is_cap], else 0
          (the token is masked out: IcePop / NeMo-RL's "icepop" with min = 1/is_cap).
    aggregation: "token-mean" = sum / #tokens;  "sequence-mean" = mean over sequences (with >= 1 token) of
      each sequence's token mean;  "dr-grpo" = sum / (B * max_tokens), max_tokens defaulting to T.
    Metrics: loss/policy (the returned loss), clip_fraction (tokens whose clipped branch is taken, so no
    gradient: TRL's clip_ratio/region_mean), ratio/mean, kl/ref (token-mean k3, when beta > 0), and with
    inference_logprobs: kl/train_inference, token_mult_prob_error, is/weight_mean, is/masked_fraction.
    """
    if logprobs.ndim != 2:
        raise ValueError(f"logprobs must be [B, T], got shape {tuple(logprobs.shape)}")
    B, T = logprobs.shape
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"aggregation must be one of {AGGREGATIONS}, got {aggregation!r}")
    if is_correction not in IS_CORRECTIONS:
        raise ValueError(f"is_correction must be one of {IS_CORRECTIONS}, got {is_correction!r}")
    if not 0.0 <= eps_low < 1.0 or eps_high < 0.0:
        raise ValueError(f"need 0 <= eps_low < 1 and eps_high >= 0, got eps_low={eps_low}, eps_high={eps_high}")
    if beta < 0.0:
        raise ValueError(f"beta must be >= 0, got {beta}")
    if beta > 0.0 and ref_logprobs is None:
        raise ValueError(f"beta={beta} > 0 needs ref_logprobs")
    if is_correction != "none" and inference_logprobs is None:
        raise ValueError(f"is_correction={is_correction!r} needs inference_logprobs")
    if is_cap <= 0.0 or (is_correction == "token-clip" and is_cap < 1.0):
        raise ValueError(f"is_cap must be > 0 (>= 1 for token-clip), got {is_cap}")
    max_tokens = T if max_tokens is None else max_tokens
    if max_tokens <= 0:
        raise ValueError(f"max_tokens must be > 0, got {max_tokens}")
    shapes = {"old_logprobs": old_logprobs, "mask": mask, "ref_logprobs": ref_logprobs,
              "inference_logprobs": inference_logprobs}
    for name, t in shapes.items():
        if t is not None and t.shape != (B, T):
            raise ValueError(f"{name} must have the shape of logprobs {(B, T)}, got {tuple(t.shape)}")
    if advantages.shape != (B,):
        raise ValueError(f"advantages must be [B]={B}, got shape {tuple(advantages.shape)}")

    def data(t: Tensor) -> Tensor:
        return t.detach().to(device=logprobs.device, dtype=torch.float32)

    lp = logprobs.float()
    old = data(old_logprobs)
    adv = data(advantages)[:, None]  # [B, 1]
    m = mask.to(logprobs.device).bool()

    ratio = torch.where(m, lp - old, 0.0).exp()  # [B, T]
    clipped = ratio.clamp(1.0 - eps_low, 1.0 + eps_high)
    per_token = -torch.minimum(ratio * adv, clipped * adv)  # [B, T]

    metrics: dict[str, Tensor] = {}  # 0-d tensors, turned into floats with one device sync at the end
    with torch.no_grad():
        r = ratio.detach()
        region = ((r < 1.0 - eps_low) & (adv < 0)) | ((r > 1.0 + eps_high) & (adv > 0))
        metrics["clip_fraction"] = masked_mean(region.float(), m)
        metrics["ratio/mean"] = masked_mean(r, m)

    if inference_logprobs is not None:
        train_minus_inf = torch.where(m, old - data(inference_logprobs), 0.0)  # log(pi_train / pi_inference)
        weight = train_minus_inf.exp()
        kept = torch.ones_like(m)
        if is_correction == "tis":
            weight = weight.clamp(max=is_cap)
        elif is_correction == "token-clip":
            kept = (weight >= 1.0 / is_cap) & (weight <= is_cap)
            weight = torch.where(kept, weight, 0.0)
        if is_correction != "none":
            per_token = per_token * weight
            metrics["is/weight_mean"] = masked_mean(weight.detach(), m)
            metrics["is/masked_fraction"] = masked_mean((~kept).float(), m)
        # NeMo-RL ClippedPGLossFn (nemo_rl/algorithms/loss_functions.py): gen_kl_error = k3 with
        # logr = prev_logprobs - generation_logprobs, i.e. KL(inference || train) at the sampled tokens, and
        # token_mult_prob_error = masked_mean(exp(|generation_logprobs - prev_logprobs|)): 1.0 = exact match.
        metrics["kl/train_inference"] = masked_mean(_k3(train_minus_inf), m)
        metrics["token_mult_prob_error"] = masked_mean(train_minus_inf.abs().exp(), m)

    if beta > 0.0:
        assert ref_logprobs is not None
        kl = _k3(torch.where(m, data(ref_logprobs) - lp, 0.0))  # [B, T], k3 of KL(pi || pi_ref)
        per_token = per_token + beta * kl
        metrics["kl/ref"] = masked_mean(kl.detach(), m)

    loss = _aggregate(per_token, m, aggregation, max_tokens)
    metrics["loss/policy"] = loss.detach()
    values = torch.stack(list(metrics.values())).tolist()
    return loss, dict(zip(metrics, values, strict=True))


def grpo_loss_for(rl: RLConfig, logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor,
                  inference_logprobs: Tensor, ref_logprobs: Tensor | None = None) -> tuple[Tensor, dict[str, float]]:
    """`grpo_loss` with the clipping, KL, aggregation and IS-correction settings of `rl.*`."""
    return grpo_loss(logprobs, old_logprobs, advantages, mask, eps_low=rl.eps_low, eps_high=rl.eps_high,
                     beta=rl.beta, ref_logprobs=ref_logprobs, aggregation=rl.aggregation, max_tokens=rl.max_new_tokens,
                     inference_logprobs=inference_logprobs, is_correction=rl.is_correction, is_cap=rl.is_cap)
