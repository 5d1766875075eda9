"""Lossless verification of a chain of draft tokens, all rows at once.

Row b proposed n[b] <= k tokens d_1..d_n with draft distributions q_i (a point
mass when the drafter gives none); the target gives p_1..p_{k+1}. Token d_i is
accepted with probability min(1, p_i(d_i) / q_i(d_i)); at the first rejection a
token is drawn from norm(max(0, p_i - q_i)), and when all n are accepted a bonus
token from p_{n+1}. The emitted tokens are then distributed exactly as the
target's own samples (Leviathan et al. 2023; Chen et al. 2023).

Greedy decoding is the special case p = point mass on the argmax: accept while
the draft equals the target's argmax, then emit the argmax. `verify_greedy` does
that on the argmax ids alone, with no [B, k+1, V] distribution built.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from codraft.rollout.sampling import sample


@dataclass
class Verdict:
    num_accepted: torch.Tensor  # [B] accepted draft tokens
    next_token: torch.Tensor  # [B] the correction or bonus token


def verify_greedy(
    draft_tokens: torch.Tensor,  # [B, k]
    num_drafts: torch.Tensor,  # [B] valid proposals per row
    target_tokens: torch.Tensor,  # [B, k + 1] the target's argmax at each fed position
) -> Verdict:
    k = draft_tokens.shape[1]
    valid = torch.arange(k, device=draft_tokens.device) < num_drafts[:, None]
    num_accepted = ((draft_tokens == target_tokens[:, :k]) & valid).long().cumprod(-1).sum(-1)
    return Verdict(num_accepted, target_tokens.gather(1, num_accepted[:, None]).squeeze(1))


def vocab_index(tokens: torch.Tensor, vocab: torch.Tensor | None) -> torch.Tensor:
    """Column of each target id in a distribution over `vocab` (ascending ids; None = the whole vocab).
    Ids outside `vocab` map to some column whose id differs; callers check `vocab[index] == tokens`."""
    if vocab is None:
        return tokens
    return torch.searchsorted(vocab, tokens.contiguous()).clamp(max=vocab.numel() - 1)


def verify(
    draft_tokens: torch.Tensor,  # [B, k]
    num_drafts: torch.Tensor,  # [B] valid proposals per row
    draft_probs: torch.Tensor | None,  # [B, k, N] or None (point masses)
    draft_vocab: torch.Tensor | None,  # [N] target ids of draft_probs' columns; None = N is the whole vocab
    target_probs: torch.Tensor,  # [B, k + 1, V]
    generator: torch.Generator | None,
) -> Verdict:
    B, k = draft_tokens.shape
    steps = torch.arange(k, device=draft_tokens.device)
    valid = steps < num_drafts[:, None]
    p_draft = target_probs[:, :k].gather(-1, draft_tokens[..., None]).squeeze(-1)  # [B, k]
    if draft_probs is None:
        accept = p_draft > torch.rand(B, k, generator=generator, device=draft_tokens.device)
    else:
        q_draft = draft_probs.gather(-1, vocab_index(draft_tokens, draft_vocab)[..., None]).squeeze(-1)
        accept = torch.rand(B, k, generator=generator, device=draft_tokens.device) * q_draft < p_draft
    num_accepted = (accept & valid).long().cumprod(-1).sum(-1)

    # distribution of the emitted token at position num_accepted
    rows = torch.arange(B, device=draft_tokens.device)
    p_next = target_probs[rows, num_accepted]  # [B, V]
    rejected = num_accepted < num_drafts
    if bool(rejected.any()):
        at = num_accepted.clamp(max=k - 1)
        if draft_probs is None:
            q_next = torch.zeros_like(p_next).scatter_(-1, draft_tokens[rows, at][:, None], 1.0)
        elif draft_vocab is None:
            q_next = draft_probs[rows, at]
        else:
            q_next = torch.zeros_like(p_next).index_copy_(-1, draft_vocab, draft_probs[rows, at].to(p_next.dtype))
        residual = (p_next - q_next).clamp(min=0)
        mass = residual.sum(-1, keepdim=True)
        # mass == 0 only when p <= q everywhere, i.e. p == q up to rounding: then p itself is right
        residual = torch.where(mass > 0, residual / mass.clamp(min=1e-30), p_next)
        p_next = torch.where(rejected[:, None], residual, p_next)
    return Verdict(num_accepted=num_accepted, next_token=sample(p_next, generator))
