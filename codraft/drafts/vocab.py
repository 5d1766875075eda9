"""The reduced draft vocabulary of EAGLE-3: the most frequent target tokens.

The draft's head scores only N target tokens. Draft id i stands for target id
`i + d2t[i]` (int64 offsets, the layout SGLang and vLLM load); `t2d[v]` says
whether target id v is in the draft vocabulary. Draft ids follow ascending
target ids (as SpecForge orders them), so a target id in the vocabulary maps
back to draft id `cumsum(t2d)[v] - 1`.

Counts come from whatever corpus the caller has: rollouts of earlier steps, or
for a fresh draft the prompts (or any text) of the task. Without counts every
token ties and the lowest N ids are taken, which only suits tests and a draft
whose vocabulary is the whole target vocabulary anyway.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch


def count_tokens(sequences: Iterable[Sequence[int] | torch.Tensor], vocab_size: int) -> torch.Tensor:
    """How often each target id occurs over `sequences` (lists or tensors of ids) -> [vocab_size] int64."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for i, seq in enumerate(sequences):
        ids = torch.as_tensor(seq, dtype=torch.long).flatten().cpu()
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
            raise ValueError(f"sequence {i} has token ids outside [0, {vocab_size})")
        counts += torch.bincount(ids, minlength=vocab_size)
    return counts


def build_draft_vocab(token_counts: torch.Tensor, draft_vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The `draft_vocab_size` most frequent ids (ties: lower id first) -> d2t [N] int64, t2d [V] bool.

    0, or a size at least the target vocabulary, means the whole target vocabulary.
    """
    if token_counts.dim() != 1:
        raise ValueError(f"token_counts must be [vocab_size]; got shape {tuple(token_counts.shape)}")
    if draft_vocab_size < 0:
        raise ValueError(f"draft_vocab_size must be >= 0, got {draft_vocab_size}")
    V = token_counts.numel()
    n = V if draft_vocab_size == 0 else min(draft_vocab_size, V)
    order = torch.sort(token_counts.cpu(), descending=True, stable=True).indices  # stable: ties keep id order
    ids = order[:n].sort().values
    d2t = ids - torch.arange(n)
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[ids] = True
    return d2t, t2d
