"""Zigzag sharding of a packed batch for context parallelism, and its inverse.

Each packed sequence of length L is padded to P = ceil(L / 2cp) * 2cp tokens and cut into 2cp chunks of
c = P / 2cp; CP rank r holds chunks r and 2cp-1-r (an early and a late chunk, so the causal work is
balanced). The local packed layout keeps the sequences in order, each as [chunk r ; chunk 2cp-1-r]
(2c tokens, positions increasing), so every rank has the same local cu_seqlens and the ring's blocks
line up. Padding tokens sit at the end of their sequence: no real token attends to them, they carry
loss-mask 0, and `is_pad` marks them.

Branch placement: EAGLE-3 TTT branches are one per token and are sharded like tokens (`shard`);
DFlash/DSpark anchors (global packed indices) go to the rank that owns their position (`route`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist


@dataclass
class ZigzagLayout:
    """Where every token of a packed batch lives under zigzag CP. Pure: built identically on every rank."""

    cp: int
    rank: int
    global_cu: torch.Tensor  # [N+1] int64, the unpadded packed batch
    chunks: torch.Tensor  # [N] int64, chunk size c_i (padded length / 2cp)
    cu_seqlens: torch.Tensor = field(init=False)  # [N+1] int32, local: sequence i holds 2 c_i tokens
    source: torch.Tensor = field(init=False)  # [T_local] int64, global packed index of each local token; -1: pad
    position_ids: torch.Tensor = field(init=False)  # [T_local] int64, position within its sequence

    def __post_init__(self):
        self.cu_seqlens, self.position_ids, self.source = self._local(self.rank)

    def _local(self, rank: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        cp = self.cp
        lengths = self.global_cu.diff()
        positions = []
        for c in self.chunks.tolist():
            early, late = rank * c, (2 * cp - 1 - rank) * c
            positions.append(torch.cat([torch.arange(early, early + c), torch.arange(late, late + c)]))
        pos = torch.cat(positions) if positions else torch.zeros(0, dtype=torch.long)
        counts = 2 * self.chunks
        seq = torch.repeat_interleave(torch.arange(len(counts)), counts)
        source = torch.where(pos < lengths[seq], self.global_cu[:-1][seq] + pos, -1)
        cu = torch.zeros(len(counts) + 1, dtype=torch.int32)
        cu[1:] = counts.cumsum(0)
        return cu, pos, source

    @property
    def num_tokens(self) -> int:
        """T_local, equal on every rank."""
        return int(self.cu_seqlens[-1])

    @property
    def is_pad(self) -> torch.Tensor:
        """[T_local] bool: padding tokens (no input, loss-mask 0)."""
        return self.source < 0

    def shard(self, x: torch.Tensor, pad_value: float | int = 0) -> torch.Tensor:
        """A per-token tensor of the packed batch [T, ...] -> this rank's tokens [T_local, ...], pads = pad_value."""
        assert x.shape[0] == int(self.global_cu[-1]), (tuple(x.shape), int(self.global_cu[-1]))
        src = self.source.to(x.device)
        out = x[src.clamp(min=0)]
        out[src < 0] = pad_value
        return out

    def unshuffle(self, parts: torch.Tensor) -> torch.Tensor:
        """Every rank's local tensor stacked, [cp * T_local, ...] -> the packed batch [T, ...], padding dropped."""
        index = torch.full((int(self.global_cu[-1]),), -1, dtype=torch.long)
        for r in range(self.cp):
            _, _, source = self._local(r)
            real = torch.nonzero(source >= 0).flatten()
            index[source[real]] = r * self.num_tokens + real
        assert bool((index >= 0).all()), "every token is held by exactly one rank"
        return parts[index.to(parts.device)]

    def route(self, anchors: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Global packed anchors [G] -> (owned [G_r]: which of them this rank holds, in order; their local
        packed indices [G_r])."""
        anchors = anchors.cpu().long()
        T = int(self.global_cu[-1])
        if anchors.numel() and (int(anchors.min()) < 0 or int(anchors.max()) >= T):
            raise ValueError(f"anchors must be packed indices in [0, T={T}); got {anchors.tolist()}")
        seq = torch.searchsorted(self.global_cu, anchors, right=True) - 1
        pos, c = anchors - self.global_cu[seq], self.chunks[seq]
        j = pos // c  # chunk index in [0, 2cp)
        owner = torch.where(j < self.cp, j, 2 * self.cp - 1 - j)
        offset = torch.where(j < self.cp, pos - j * c, c + pos - j * c)
        owned = torch.nonzero(owner == self.rank).flatten()
        return owned, self.cu_seqlens.long()[seq[owned]] + offset[owned]


def zigzag_layout(cu_seqlens: torch.Tensor, cp: int, rank: int) -> ZigzagLayout:
    """The layout of packed sequences `cu_seqlens` [N+1] on CP rank `rank` of `cp`."""
    cu = cu_seqlens.cpu().long()
    if cu.dim() != 1 or cu.numel() < 1 or int(cu[0]) != 0 or bool((cu.diff() < 0).any()):
        raise ValueError(f"cu_seqlens must be [N+1], non-decreasing from 0; got {cu.tolist()}")
    if not 0 <= rank < cp:
        raise ValueError(f"CP rank {rank} is not in [0, cp={cp})")
    chunks = (cu.diff() + 2 * cp - 1) // (2 * cp)
    return ZigzagLayout(cp, rank, cu, chunks)


@dataclass
class CPBatch:
    """One rank's share of a packed batch."""

    input_ids: torch.Tensor  # [T_local], pads = pad_id
    position_ids: torch.Tensor  # [T_local], global positions within each sequence
    loss_mask: torch.Tensor  # [T_local], 0 on padding
    cu_seqlens: torch.Tensor  # [N+1] local
    per_token: dict[str, torch.Tensor]  # each [T_local, ...], pads = 0
    layout: ZigzagLayout


def _agree(group: dist.ProcessGroup | None, descriptor: tuple, error: str | None) -> None:
    """All-gather a small descriptor and any local error; every rank raises the same ValueError on a problem."""
    cp = dist.get_world_size(group)
    seen: list = [None] * cp
    dist.all_gather_object(seen, (descriptor, error), group=group)
    errors = [f"rank {r}: {e}" for r, (_, e) in enumerate(seen) if e is not None]
    if errors:
        raise ValueError("CP sharding rejected the batch on " + "; ".join(errors))
    if any(d != seen[0][0] for d, _ in seen):
        shown = "; ".join(f"rank {r}: {d}" for r, (d, _) in enumerate(seen))
        raise ValueError(f"CP ranks must shard the same packed batch, but they were given different ones ({shown})")


def shard_batch(
    input_ids: torch.Tensor,
    cu_seqlens: torch.Tensor,
    group: dist.ProcessGroup | None,
    *,
    loss_mask: torch.Tensor | None = None,
    per_token: dict[str, torch.Tensor] | None = None,
    pad_id: int = 0,
) -> CPBatch:
    """Zigzag-shard a packed batch (input_ids [T], cu_seqlens [N+1], loss_mask [T], per_token {name: [T, ...]})
    over the CP group. Collective: every CP rank calls it with the same batch; a bad or mismatched batch
    raises the same ValueError on every rank (one small all-gather), never a hang in the ring."""
    per_token = per_token or {}
    T = int(input_ids.shape[0]) if input_ids.dim() == 1 else -1
    error = None
    if input_ids.dim() != 1:
        error = f"input_ids must be packed [T]; got {tuple(input_ids.shape)}"
    elif cu_seqlens.dim() != 1 or int(cu_seqlens[0]) != 0 or int(cu_seqlens[-1]) != T:
        error = f"cu_seqlens must run from 0 to T={T}; got {cu_seqlens.tolist()}"
    elif bool((cu_seqlens.diff() < 0).any()):
        error = f"cu_seqlens must be non-decreasing; got {cu_seqlens.tolist()}"
    else:
        tensors = {"loss_mask": loss_mask, **per_token}
        bad = {n: tuple(t.shape) for n, t in tensors.items() if t is not None and (t.dim() == 0 or t.shape[0] != T)}
        if bad:
            error = f"per-token tensors must have T={T} rows; got {bad}"
    lengths = cu_seqlens.diff().tolist() if error is None else []
    descriptor = (T, lengths, sorted((n, tuple(t.shape[1:]), str(t.dtype)) for n, t in per_token.items()))
    cp, rank = (1, 0) if group is None else (dist.get_world_size(group), dist.get_rank(group))
    if group is not None:
        _agree(group, descriptor, error)
    elif error is not None:
        raise ValueError(error)
    layout = zigzag_layout(cu_seqlens, cp, rank)
    if loss_mask is None:
        loss_mask = torch.ones(T, dtype=torch.float32, device=input_ids.device)
    return CPBatch(
        input_ids=layout.shard(input_ids, pad_id),
        position_ids=layout.position_ids.to(input_ids.device),
        loss_mask=layout.shard(loss_mask, 0),
        cu_seqlens=layout.cu_seqlens.to(cu_seqlens.device),
        per_token={n: layout.shard(t, 0) for n, t in per_token.items()},
        layout=layout,
    )


class _GatherFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, layout: ZigzagLayout, group):
        # x [T_local, ...] -> [T, ...]
        parts = [torch.empty_like(x) for _ in range(layout.cp)]
        dist.all_gather(parts, x.contiguous(), group=group)
        ctx.layout = layout
        return layout.unshuffle(torch.cat(parts))

    @staticmethod
    def backward(ctx, grad):
        # every CP rank holds the same gradient of the gathered tensor: this rank's tokens take their rows, no comm
        layout: ZigzagLayout = ctx.layout
        real = torch.nonzero(~layout.is_pad).flatten().to(grad.device)
        dx = grad.new_zeros(layout.num_tokens, *grad.shape[1:])
        dx[real] = grad[layout.source.to(grad.device)[real]]
        return dx, None, None


def gather(x: torch.Tensor, layout: ZigzagLayout, group: dist.ProcessGroup | None) -> torch.Tensor:
    """This rank's tokens [T_local, ...] -> the whole packed batch [T, ...] on every CP rank, padding dropped.

    Collective (all-gather + unshuffle). Differentiable with the usual CP semantics: every CP rank computes
    the same function of the gathered tensor, and the backward hands each rank the rows of its own tokens.
    """
    if group is None or layout.cp == 1:
        return layout.unshuffle(x)
    return _GatherFn.apply(x, layout, group)
