"""This rank's view of a packed batch under context parallelism (the `BatchView` of rl/batch.py, zigzag-sharded).

  view      the packed batch is zigzag-sharded (cp_shard.shard_batch); the policy runs with ring
            attention (apply_cp) at global positions, the draft with ring branch attention
            (apply_cp_to_draft) and a `CPTokenShard` for its look-ahead (cp_draft.py);
  log-probs the token a logits row predicts is the NEXT token, which may live on another rank, so it
            is shifted on the whole batch before sharding; each rank computes the log-probs of its
            rows, and a differentiable all-gather (cp_shard.gather) gives every rank all of them;
  losses    GRPO then runs on the whole batch's log-probs, the draft loss sums its denominators
            over the group: every rank holds the cp=1 loss, and its backward yields its own tokens'
            share of the gradient (summed over the group by collectives.reduce_gradients).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
import torch.distributed as dist

from codraft.parallel.cp_draft import CPTokenShard
from codraft.parallel.cp_shard import gather, shard_batch
from codraft.parallel.mesh import ParallelDims
from codraft.rl.batch import BatchView, PackedRollouts, RowFn, whole_view


@dataclass
class CPBatchView(BatchView):
    """`shard` is a CPTokenShard: its zigzag layout and CP group."""

    next_ids: torch.Tensor | None = None  # [T_local] the token after each local token (whole-batch shift)
    predicts_response: torch.Tensor | None = None  # [T_local] bool: the row predicts a response token

    def per_response(self, fn: RowFn, logits: torch.Tensor) -> torch.Tensor:
        rows = self.logit_rows()
        values = fn(logits[rows], self.next_ids[rows])  # [R_local]
        layout = self.shard.layout
        local = values.new_zeros(layout.num_tokens).index_put((rows,), values)  # [T_local]
        return gather(local, layout, self.shard.group)[self.batch.logprob_index]  # [T] -> [R]

    def logit_rows(self) -> torch.Tensor:
        return torch.nonzero(self.predicts_response).flatten()


def cp_view(batch: PackedRollouts, group: dist.ProcessGroup) -> CPBatchView:
    """This rank's zigzag share of `batch` over the CP `group` (collective over it)."""
    T = batch.input_ids.numel()
    predicts = torch.zeros(T, dtype=torch.bool, device=batch.input_ids.device)
    predicts[batch.logprob_index] = True
    local = shard_batch(
        batch.input_ids,
        batch.cu_seqlens,
        group,
        loss_mask=batch.response_mask,
        per_token={"next_ids": batch.input_ids.roll(-1), "predicts_response": predicts},
    )
    shard = CPTokenShard(batch.input_ids, batch.response_mask, batch.cu_seqlens, local.layout, group)
    return CPBatchView(
        batch,
        local.input_ids,
        local.position_ids,
        local.cu_seqlens,
        local.loss_mask,
        shard,
        next_ids=local.per_token["next_ids"],
        predicts_response=local.per_token["predicts_response"],
    )


def batch_view(dims: ParallelDims) -> Callable[[PackedRollouts], BatchView]:
    """How this rank sees a packed batch: all of it, or its zigzag share over the CP group."""
    return whole_view if dims.cp == 1 else partial(cp_view, group=dims.cp_group)
