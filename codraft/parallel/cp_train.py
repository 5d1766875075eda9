"""The co-training step under context parallelism: the CP `Sharding` the trainer uses (rl/sharding.py).

Per step, on the cp ranks of a CP group (every rank holds full policy and draft weights):

  rollout   CP rank 0 generates with the whole policy and broadcasts the rollout and its torch RNG
            state, so every rank scores the same samples and later draws the same DFlash anchors;
  view      the packed batch is zigzag-sharded (cp_shard.shard_batch); the policy runs with ring
            attention (apply_cp) at global positions, the draft with ring branch attention
            (apply_cp_to_draft) and a `CPTokenShard` for its look-ahead (cp_draft.py);
  log-probs the token a logits row predicts is the NEXT token, which may live on another rank, so it
            is shifted on the whole batch before sharding; each rank computes the log-probs of its
            rows, and a differentiable all-gather (cp_shard.gather) gives every rank all of them;
  losses    GRPO then runs on the whole batch's log-probs, the draft loss sums its denominators
            over the group: every rank holds the cp=1 loss, and its backward yields its own tokens'
            share of the gradient;
  gradients summed over the group (one all-reduce per module), before clipping and the optimizer
            steps, so every rank keeps identical weights and grad norms.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from codraft.config import Config, ConfigError
from codraft.parallel.cp_draft import CPTokenShard, apply_cp_to_draft
from codraft.parallel.cp_shard import gather, shard_batch
from codraft.parallel.group_sharding import GroupSharding, all_reduce_grads
from codraft.parallel.mesh import ParallelDims, init_distributed
from codraft.parallel.ring_attention import apply_cp
from codraft.rl.batch import PackedRollouts
from codraft.rl.sharding import BatchView, RowFn, Sharding

log = logging.getLogger(__name__)


@dataclass
class CPBatchView(BatchView):
    """`shard` is a CPTokenShard: its zigzag layout and CP group."""

    next_ids: torch.Tensor | None = None  # [T_local] the token after each local token (whole-batch shift)
    predicts_response: torch.Tensor | None = None  # [T_local] bool: the row predicts a response token

    def per_response(self, fn: RowFn, logits: torch.Tensor) -> torch.Tensor:
        rows = torch.nonzero(self.predicts_response).flatten()
        values = fn(logits[rows], self.next_ids[rows])  # [R_local]
        layout = self.shard.layout
        local = values.new_zeros(layout.num_tokens).index_put((rows,), values)  # [T_local]
        return gather(local, layout, self.shard.group)[self.batch.logprob_index]  # [T] -> [R]


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


class ContextParallel(GroupSharding):
    """cp ranks share every step's batch; ParallelDims has built the groups."""

    def __init__(self, dims: ParallelDims):
        super().__init__(dims, dims.cp_group, dims.cp_ranks)

    def apply(self, policy: nn.Module, draft: nn.Module | None) -> None:
        super().apply(policy, draft)
        apply_cp(policy, self.dims)
        if draft is not None:
            apply_cp_to_draft(draft, self.dims)

    def view(self, batch: PackedRollouts) -> CPBatchView:
        return cp_view(batch, self.group)

    def reduce_gradients(self, modules: list[nn.Module]) -> None:
        all_reduce_grads(modules, self.group)


def sharding_for(cfg: Config) -> Sharding:
    """The trainer's sharding from `parallel.*` and the launched world (torchrun's env, or none)."""
    p = cfg.parallel
    if p.dp > 1:  # replicas of a pipeline are pp_train's; plain data parallelism is not built
        raise ConfigError(f"parallel.dp={p.dp} runs with parallel.pp > 1 for now (got pp=1)")
    if p.cp == 1:
        return Sharding()
    _, world_size = init_distributed(p.timeout_s)
    dims = ParallelDims(p.dp, p.pp, p.cp, world_size)  # cp must equal the world size: same error on every rank
    return ContextParallel(dims.build(p.timeout_s))
