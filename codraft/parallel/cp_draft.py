"""Context parallelism for the drafts: ring branch attention, and look-ahead across zigzag chunks.

`apply_cp_to_draft` swaps the draft's training attention for the zigzag ring (as `apply_cp` does for
the policy); the draft's code does not change. `CPTokenShard` is the CP `TokenShard` (drafts/shard.py)
a draft reads its look-ahead through:

  - token ids and the loss mask are held whole by every rank, so look-ahead into them is plain indexing;
  - the policy's logits exist only per rank. A look-ahead of j tokens from a token of chunk i lands in
    chunk i or, at offset < j, in a later chunk, so the first h rows of every chunk (h = the furthest
    offset any rank asks for, agreed by one all-reduce) plus the local rows answer every request
    exactly: one all-gather of those chunk heads, h ~ TTT steps or block size, not the sequence;
  - DFlash anchors are sampled on the whole batch (same generator on every rank) and each rank
    computes the blocks it owns (`ZigzagLayout.route`): the ring serves their context keys;
  - loss denominators are summed over the CP group by a differentiable all-reduce whose backward is
    the identity: every rank then holds the whole batch's loss, and its backward yields exactly its
    own tokens' share of the gradient, so summing gradients over the group gives the cp=1 gradient.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch
import torch.distributed as dist

from codraft.drafts.base import DraftModel
from codraft.drafts.shard import TokenShard
from codraft.parallel.cp_shard import ZigzagLayout
from codraft.parallel.ring_attention import ring_branch_attention


def apply_cp_to_draft(draft: DraftModel, parallel_dims) -> DraftModel:
    """Swap the draft's training attention to zigzag ring branch attention over the CP group (in place).
    The caller feeds the zigzag shard in a DraftBatch with a `CPTokenShard`. cp == 1 leaves it as it is."""
    if parallel_dims.cp > 1:
        draft.attention_op = partial(ring_branch_attention, group=parallel_dims.cp_group)
    return draft


class _AllSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        out = x.clone()
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        # every rank computes the same function of the sum: d(sum)/d(x_r) = 1, no communication
        return grad, None


@dataclass
class CPTokenShard(TokenShard):
    """The zigzag share of one CP rank; input_ids/loss_mask/cu_seqlens are the whole batch's."""

    layout: ZigzagLayout | None = None
    group: dist.ProcessGroup | None = None

    @property
    def index(self) -> torch.Tensor:
        """[T_local] global index of each local token; a pad takes its sequence's last token, so every
        look-ahead from it crosses the sequence end and is masked."""
        source, lengths = self.layout.source, self.layout.global_cu.diff()
        seq = torch.repeat_interleave(torch.arange(lengths.numel()), 2 * self.layout.chunks)
        return torch.where(source >= 0, source, self.layout.global_cu[1:][seq] - 1).to(self.input_ids.device)

    def rows(self, x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        L, cp = self.layout, self.layout.cp
        flat = index.reshape(-1).cpu()
        seq = torch.searchsorted(L.global_cu, flat, right=True) - 1
        c = L.chunks[seq]
        pos = flat - L.global_cu[seq]
        j = pos // c  # chunk index in [0, 2cp)
        owner, late, off = torch.where(j < cp, j, 2 * cp - 1 - j), (j >= cp).long(), pos - j * c
        mine = owner == L.rank
        local = L.cu_seqlens.long()[seq] + late * c + off  # valid where mine
        h = torch.tensor(int(off[~mine].max()) + 1 if bool((~mine).any()) else 0, device=x.device)  # NCCL: on device
        dist.all_reduce(h, op=dist.ReduceOp.MAX, group=self.group)  # every rank gathers heads of one size
        out = x[local.clamp(max=L.num_tokens - 1).to(x.device)]
        if int(h):
            heads = self._gather_heads(x, int(h))  # [cp, N, 2, h, ...]
            far = torch.nonzero(~mine).flatten()
            out[far.to(x.device)] = heads[owner[far], seq[far], late[far], off[far]]
        return out.view(*index.shape, *x.shape[1:])

    def _gather_heads(self, x: torch.Tensor, h: int) -> torch.Tensor:
        """The first h rows of both local chunks of every sequence, from every rank -> [cp, N, 2, h, ...]
        (rows past a chunk shorter than h repeat its last row; they are never asked for)."""
        L = self.layout
        c = L.chunks[:, None, None]  # [N, 1, 1]
        start = L.cu_seqlens.long()[:-1, None, None] + torch.arange(2)[None, :, None] * c
        heads = x[(start + torch.arange(h).minimum(c - 1)).to(x.device)]  # [N, 2, h, ...]
        wire = heads.to(torch.uint8) if heads.dtype == torch.bool else heads  # gloo has no bool
        parts = [torch.empty_like(wire) for _ in range(L.cp)]
        dist.all_gather(parts, wire.contiguous(), group=self.group)
        return torch.stack(parts).to(heads.dtype).to(x.device)

    def own(self, anchors: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        owned, local = self.layout.route(anchors)
        return owned.to(anchors.device), local.to(anchors.device)

    def total(self, x: torch.Tensor) -> torch.Tensor:
        return _AllSum.apply(x, self.group)
