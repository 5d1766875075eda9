"""Where a draft's training tokens sit in the packed rollout batch, and how the draft reaches past them.

Drafts look ahead: EAGLE-3 at token t reads x_{t+1+s} and the policy's row t+1+s for TTT step s, a
DFlash block anchored at a reads x_{a+1..a+b-1} and the policy's rows a..a+b-2. Under context
parallelism the token ahead may live on another rank, so a draft indexes every look-ahead by GLOBAL
packed index through a `TokenShard`:

  input_ids, loss_mask, cu_seqlens   the whole packed batch, held by every rank (rollout tokens are
                                     small and every rank has them);
  index                              [T_local] the global index of each token the rank computes on;
  rows(x, index)                     rows of a per-token tensor that exists only per rank (the
                                     policy's logits) at global indices;
  own(anchors)                       which global anchors this rank computes, and their local indices;
  total(x)                           a sum over the ranks, for the denominators that normalise a loss
                                     (every rank then holds the same loss of the whole batch).

This class is the single-device shard: all tokens, identity maps. `codraft.parallel.cp_draft` holds
the zigzag CP one; a draft's code is the same for both.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class TokenShard:
    input_ids: torch.Tensor  # [T] the whole packed batch
    loss_mask: torch.Tensor  # [T] bool
    cu_seqlens: torch.Tensor  # [N+1] of the whole batch

    @property
    def num_tokens(self) -> int:
        """T, the whole batch's token count."""
        return self.input_ids.numel()

    @property
    def index(self) -> torch.Tensor:
        """[T_local] global packed index of each local token."""
        return torch.arange(self.num_tokens, device=self.input_ids.device)

    def seq_end(self, index: torch.Tensor) -> torch.Tensor:
        """End (exclusive global index) of the sequence of each global index, same shape."""
        cu = self.cu_seqlens.to(index.device)
        return cu[torch.searchsorted(cu, index, right=True)]

    def rows(self, x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """Rows of the local per-token tensor x [T_local, ...] at global indices [*S] -> [*S, ...]."""
        return x[index]

    def own(self, anchors: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Global anchors [G] -> (which of them this rank computes [G_r], their local indices [G_r])."""
        return torch.arange(anchors.numel(), device=anchors.device), anchors

    def total(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of x over the ranks (differentiable: each rank's backward hands x the gradient of the sum)."""
        return x
