"""The tokens of a packed rollout batch that one process computes on (`BatchView`), and the way back from
per-token results to the whole batch. `whole_view` is a single process's view: every token.
`codraft.parallel.cp_view` is the context-parallel one (this rank's zigzag share)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from codraft.drafts import DraftBatch
from codraft.drafts.shard import TokenShard
from codraft.models.model import packed_positions
from codraft.rl.batch import PackedRollouts, token_entropy, token_logprobs

# (logits rows [R, V], the token each row predicts [R]) -> a value per row [R]
RowFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class BatchView:
    """The tokens of a packed rollout batch that this rank computes on, and the way back from per-token
    results to the whole batch's response tokens. Single device: the whole batch."""

    batch: PackedRollouts
    input_ids: torch.Tensor  # [T_local]
    positions: torch.Tensor  # [T_local] rotary positions within each sequence
    cu_seqlens: torch.Tensor  # [N+1] local
    loss_mask: torch.Tensor  # [T_local] bool, response tokens (False on padding)
    shard: TokenShard  # where the local tokens sit in the whole batch (the draft's look-ahead)

    def per_response(self, fn: RowFn, logits: torch.Tensor) -> torch.Tensor:
        """fn over the logits rows [T_local, V] that predict response tokens -> [R] in response order."""
        b = self.batch
        return fn(logits[b.logprob_index], b.input_ids[b.logprob_index + 1])

    def response_logprobs(self, logits: torch.Tensor, temperature: float) -> torch.Tensor:
        """[R] log p of every response token, differentiable."""
        return self.per_response(lambda rows, targets: token_logprobs(rows, targets, temperature), logits)

    @torch.no_grad()
    def response_entropy(self, logits: torch.Tensor, temperature: float) -> torch.Tensor:
        """Mean entropy of the policy's sampling distribution over response tokens."""
        return self.per_response(lambda rows, _: token_entropy(rows, temperature), logits).mean()

    def draft_batch(self, taps: dict[int, torch.Tensor], logits: torch.Tensor) -> DraftBatch:
        """The draft's training batch of the local tokens: taps {layer: [T_local, H]}, logits [T_local, V]."""
        return DraftBatch(
            input_ids=self.input_ids,
            taps={i: t.detach() for i, t in taps.items()},
            policy_logits=logits.detach(),
            loss_mask=self.loss_mask,
            cu_seqlens=self.cu_seqlens,
            positions=self.positions,
            shard=self.shard,
        )


def whole_view(batch: PackedRollouts) -> BatchView:
    """The view of a process that computes on the whole batch."""
    shard = TokenShard(batch.input_ids, batch.response_mask, batch.cu_seqlens)
    return BatchView(batch, batch.input_ids, packed_positions(batch.cu_seqlens), batch.cu_seqlens,
                     batch.response_mask, shard)
