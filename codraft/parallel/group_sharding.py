"""What the multi-process shardings (context and pipeline parallel) share: the ranks of one process
group take each step's rollout from the group's first rank, start from rank 0's weights, and let
global rank 0 alone write metrics and checkpoints."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from codraft.models.linear import unpack_linears
from codraft.parallel.mesh import ParallelDims
from codraft.parallel.rollcall import is_peer_fault
from codraft.rl.sharding import Sharding


def all_reduce_grads(modules: list[nn.Module], group: dist.ProcessGroup, divide_by: int = 1) -> None:
    """Sum of every rank's gradients (each divided by `divide_by` first: a mean when it is the group size),
    one flat all-reduce per module; every rank holds gradients for the same parameters."""
    for module in modules:
        grads = [p.grad for p in module.parameters() if p.grad is not None]
        if grads:
            flat = torch.cat([g.flatten() for g in grads])
            if divide_by != 1:
                flat /= divide_by
            dist.all_reduce(flat, group=group)
            for g, part in zip(grads, flat.split([g.numel() for g in grads]), strict=True):
                g.copy_(part.view_as(g))


class GroupSharding(Sharding):
    def __init__(self, dims: ParallelDims, group: dist.ProcessGroup, group_ranks: list[int]):
        self.dims, self.group = dims, group
        self.root = group_ranks[0]  # global rank of the group's first rank (broadcasts take global ranks)
        self.is_writer = dims.rank == 0

    def broadcast(self, obj, src: int | None = None, group: dist.ProcessGroup | None = None):
        """obj from global rank `src` (default: the group's first rank) to `group` (default: this group)."""
        box = [obj]
        dist.broadcast_object_list(box, src=self.root if src is None else src, group=group or self.group)
        return box[0]

    def anyone(self, flag: bool) -> bool:
        t = torch.tensor([int(flag)], device="cuda" if dist.get_backend() == "nccl" else "cpu")
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return bool(t)

    @contextmanager
    def watch(self) -> Iterator[None]:
        """A wait on other ranks that timed out or lost its peer becomes a one-line RankTimeout naming the ranks
        that do not answer a roll call (rollcall.py)."""
        try:
            yield
        except Exception as e:
            if not is_peer_fault(e):
                raise
            raise self.dims.roll_call.error(e) from e

    def prepare_run_dir(self, cfg) -> Path:
        """Rank 0 creates the run directory; the others take its path (run.dir may be a fresh timestamp)."""
        path = super().prepare_run_dir(cfg) if self.is_writer else None
        cfg.run.dir = self.broadcast(None if path is None else str(path), 0, dist.group.WORLD)
        return Path(cfg.run.dir)

    def apply(self, policy: nn.Module, draft: nn.Module | None) -> None:
        """Every rank starts from rank 0's policy and draft, whatever the init."""
        for module in (policy, draft):
            if module is not None:
                for t in (*module.parameters(), *module.buffers()):
                    dist.broadcast(t.data, src=0)
                unpack_linears(module)  # the broadcast bypassed the version counters that packing reads

    def rollout(self, generate: Callable):
        """The group's first rank generates; every rank of the group gets its rollout and its RNG state after it."""
        out = (generate(), torch.get_rng_state()) if dist.get_rank() == self.root else None
        rollout, rng = self.broadcast(out)
        torch.set_rng_state(rng)
        return rollout
