"""The Drafter protocol: how any draft source plugs into the rollout engine.

The engine owns the target's KV cache; a drafter owns whatever state it needs
(token history, its own KV cache, features) and keeps it in step through three
calls per verify step:

    propose(pending, k)      -> up to k tokens per row (and their distributions); a chain
                              drafter (`stops_early`) may end early by the controller's rule
    commit(tokens, kept, taps) after verification: the tokens now in the target's
                              cache and the target's taps for them
    keep_rows(rows)          when the engine drops finished rows from the batch
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from codraft.rollout.sampling import SamplingParams


def right_padded(prompts: Sequence[Sequence[int]], device: torch.device | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Token lists as ids [B, longest] (right-padded with 0) and their lengths [B]: the prompts as the engine's
    prefill and a drafter's start read them."""
    lengths = torch.tensor([len(p) for p in prompts], device=device)
    ids = torch.zeros(len(prompts), int(lengths.max()), dtype=torch.long, device=device)
    for i, p in enumerate(prompts):
        ids[i, : len(p)] = torch.tensor(p)
    return ids, lengths


@dataclass
class Proposal:
    tokens: torch.Tensor  # [B, k'] long, k' <= k (entries past `lengths` are ignored)
    lengths: torch.Tensor  # [B] long, valid proposals per row, <= k
    probs: torch.Tensor | None = None  # [B, k, N] draft distributions; None = point masses
    vocab: torch.Tensor | None = None  # [N] ascending target ids that probs cover (q = 0 elsewhere); None = all V
    confidence: torch.Tensor | None = None  # [B, k'] the draft's probability of each token; None = unknown

    def padded(self, rows: int) -> Proposal:
        """This proposal of the first rows of a batch of `rows`, the others with no drafts."""
        def pad(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else torch.cat([t, t.new_zeros(rows - t.shape[0], *t.shape[1:])])

        return Proposal(pad(self.tokens), pad(self.lengths), pad(self.probs), self.vocab, pad(self.confidence))


class Drafter:
    """Base class; subclasses override what they need.

    `tap_layers`: target layers whose outputs (residual stream) the drafter reads;
    the engine asks the target to return them on every forward.
    """

    tap_layers: tuple[int, ...] = ()
    model: nn.Module | None = None  # a learned drafter's weights, which the engine packs for inference
    model_dtype: torch.dtype | None = None  # the dtype of those packed copies (None: the weights' own)
    stops_early: bool = False  # drafts one token per forward and takes `stop` in propose

    def start(
        self,
        prompts: list[list[int]],
        taps: dict[int, torch.Tensor],
        params: SamplingParams,
        max_len: int,
        generator: torch.Generator | None = None,
    ) -> None:
        """A new batch. `taps[layer]` is [B, P, H] for the right-padded prompts; no row will
        ever hold more than `max_len` tokens (prompt + output + speculation). Drafters that
        sample draw from `generator`, so a seeded generate call is reproducible."""

    def propose(self, pending: torch.Tensor, k: int, probe_rows: int | None = None,
                stop: Callable[[torch.Tensor], bool] | None = None) -> Proposal:
        """pending [B]: the last emitted token of each row (not yet in the target's cache). `probe_rows`: this
        is a probe, which samples acceptance on the drafts of the first `probe_rows` rows only, so a drafter
        may propose nothing for the others (a learned draft does not run on them, and skips their old context,
        prompt included). `stop` (passed to a drafter that `stops_early`): called with the confidences [B, i] of
        the first i drafts, True ends the proposal there."""
        raise NotImplementedError

    def commit(self, tokens: torch.Tensor, kept: torch.Tensor, taps: dict[int, torch.Tensor]) -> None:
        """tokens [B, t] were fed to the target; the first kept[b] of row b are now in its
        cache (the pending token plus the accepted drafts). taps[layer]: [B, t, H]."""

    def keep_rows(self, rows: torch.Tensor) -> None:
        """Only `rows` (indices into the current batch) continue, new row i being old row rows[i] (not always in
        ascending order: the engine refills finished rows' slots from the end of the batch)."""
