"""The reduced draft vocabulary: the most frequent target tokens.

EAGLE-3 trains its own head over it. DFlash and DSpark train against the whole
vocabulary through the policy's head, and at inference score only its rows for
these tokens (`HeadRows`): a block's logits over 49,152 tokens cost SmolLM2 a
113 MB read per block, most of a block's cost, for tokens the task never drafts.

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
from torch import nn

from codraft.models.linear import Linear, pack_linears


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


def draft_vocab(token_counts: torch.Tensor | None, vocab_size: int,
                draft_vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`build_draft_vocab` over counts of the policy's `vocab_size` ids (None: no counts, the lowest ids)."""
    if token_counts is None:
        token_counts = torch.zeros(vocab_size, dtype=torch.long)
    if token_counts.shape != (vocab_size,):
        raise ValueError(f"token_counts must be [{vocab_size}] (the policy's vocab); got {tuple(token_counts.shape)}")
    return build_draft_vocab(token_counts, draft_vocab_size)


def vocab_ids(d2t: torch.Tensor) -> torch.Tensor:
    """Ascending target ids of the draft vocabulary [N]."""
    return torch.arange(d2t.numel(), device=d2t.device) + d2t


class HeadRows:
    """`weight[ids]` as a packed Linear for inference, re-gathered when `weight` changed (an optimizer step or a
    refit's broadcast bumps its version; a `.to()` moves it) or `ids` did. Not a Module: it holds no parameters of
    its own."""

    def __init__(self) -> None:
        self.key: tuple | None = None
        self.linear: Linear | None = None

    def __call__(self, weight: torch.Tensor, ids: torch.Tensor, dtype: torch.dtype | None = None) -> Linear:
        """The rows as a Linear packed in `dtype` (default: the weight's)."""
        key = (weight._version, weight.data_ptr(), ids.data_ptr(), dtype)
        if self.linear is None or key != self.key:
            # not an inference tensor, though rollouts run under inference_mode: packing keys on its version
            with torch.inference_mode(False), torch.no_grad():
                linear = Linear(weight.shape[1], ids.numel(), bias=False, device="meta")  # no init to overwrite
                linear.weight = nn.Parameter(weight[ids], requires_grad=False)
                pack_linears(linear, dtype=dtype)
            self.key, self.linear = key, linear
        return self.linear
