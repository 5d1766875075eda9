"""USP (Ulysses x ring), the baseline the report compares zigzag ring branch attention against.

The CP group of size cp splits as u x R (`ParallelDims.usp_groups`: Ulysses innermost, so a Ulysses
group is u consecutive CP ranks). Inputs are the same zigzag shard of degree cp as for the ring. An
all-to-all in the Ulysses group scatters heads and gathers the sequence: each rank then holds H/u query
heads and Hkv/u KV heads of the u members' tokens. Ulysses group g holds chunks gu..gu+u-1 and their
mirrors, which is exactly ring rank g's zigzag shard of degree R with chunks u times larger: per
sequence, the members' first halves in member order, then their second halves in reverse order. The
ring op runs on that over the ring group (branch-local terms merged by LSE inside it), and a second
all-to-all scatters the sequence back and gathers the heads. Branch groups travel with their anchors'
tokens (each rank sends its groups' head slices to every member). Like SpecForge's USP this needs both
head counts divisible by u; the query-heads-only constraint of Ulysses alone is not enough with GQA.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from codraft.attention.branches import AttentionOutput, Branches, check_inputs
from codraft.parallel.ring_attention import ring_branch_attention


class AllToAll(torch.autograd.Function):
    """all_to_all_single along dim 0 with row splits; the backward is the reverse exchange."""

    @staticmethod
    def forward(ctx, x, in_splits: list[int], out_splits: list[int], group):
        out = x.new_empty(sum(out_splits), *x.shape[1:])
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        ctx.splits, ctx.group = (in_splits, out_splits), group
        ctx.set_materialize_grads(False)
        return out

    @staticmethod
    def backward(ctx, grad):
        if grad is None:
            return None, None, None, None
        in_splits, out_splits = ctx.splits
        return AllToAll.apply(grad, out_splits, in_splits, ctx.group), None, None, None


def _scatter_heads(x: torch.Tensor, counts: list[int], group) -> torch.Tensor:
    """[n, ..., H, D] rows of this rank -> [sum(counts), ..., H/u, D]: every member's rows, head slice u_rank."""
    u = len(counts)
    n = x.shape[0]
    parts = x.unflatten(-2, (u, x.shape[-2] // u)).movedim(-3, 0)  # [u, n, ..., H/u, D]
    return AllToAll.apply(parts.reshape(u * n, *parts.shape[2:]), [n] * u, counts, group)


def _gather_heads(x: torch.Tensor, counts: list[int], n: int, group) -> torch.Tensor:
    """The inverse of `_scatter_heads`: [sum(counts), ..., H/u, D] -> [n, ..., H, D]."""
    u = len(counts)
    parts = AllToAll.apply(x, counts, [n] * u, group).unflatten(0, (u, n))  # [u, n, ..., H/u, D]
    return parts.movedim(0, -3).flatten(-3, -2)


def _ring_layout(cu_seqlens: torch.Tensor, u: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of the gathered [u * T] tokens (member-major) in ring-shard order, and the ring's cu_seqlens."""
    T, cu = int(cu_seqlens[-1]), cu_seqlens.tolist()
    perm = []
    for s, e in zip(cu[:-1], cu[1:], strict=True):
        c = (e - s) // 2
        firsts = [torch.arange(j * T + s, j * T + s + c) for j in range(u)]  # chunks gu + j, increasing
        seconds = [torch.arange(j * T + s + c, j * T + e) for j in reversed(range(u))]  # mirrors, increasing
        perm += firsts + seconds
    perm = torch.cat(perm) if perm else torch.zeros(0, dtype=torch.long)
    return perm.to(cu_seqlens.device), (cu_seqlens * u).to(cu_seqlens.dtype)


def usp_branch_attention(
    q: torch.Tensor | None,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    branches: Branches | None,
    ulysses_group: dist.ProcessGroup,
    ring_group: dist.ProcessGroup | None,
    *,
    scale: float | None = None,
) -> AttentionOutput:
    """`branch_attention` on a zigzag CP shard (as `ring_branch_attention`), computed the USP way.

    Collective over the CP group split into (ulysses_group, ring_group) by `ParallelDims.usp_groups`.
    Raises ValueError unless both the query and the KV head counts divide by the Ulysses degree.
    """
    check_inputs(q, k, v, cu_seqlens, branches)
    u = dist.get_world_size(ulysses_group)
    H, Hkv = (branches.q if q is None else q).shape[-2], k.shape[1]
    if H % u or Hkv % u:
        raise ValueError(
            f"USP needs both head counts divisible by the Ulysses degree: query heads {H}, KV heads {Hkv}, "
            f"ulysses_degree {u}"
        )
    if u == 1:
        return ring_branch_attention(q, k, v, cu_seqlens, branches, ring_group, scale=scale)
    T = k.shape[0]
    perm, ring_cu = _ring_layout(cu_seqlens, u)
    tokens = [T] * u

    def to_ring(x):  # [T, heads, D] -> [u*T, heads/u, D] in ring-shard order
        return _scatter_heads(x, tokens, ulysses_group)[perm]

    def from_ring(x):  # the inverse, for outputs [u*T, H/u, D] and LSE [u*T, H/u]
        unpermuted = torch.empty_like(x).index_copy(0, perm, x)
        if x.dim() == 2:
            return _gather_heads(unpermuted[..., None], tokens, T, ulysses_group)[..., 0]
        return _gather_heads(unpermuted, tokens, T, ulysses_group)

    ring_branches = groups = None
    if branches is not None:
        G = torch.tensor([branches.q.shape[0]])
        seen = [torch.empty_like(G) for _ in range(u)]
        dist.all_gather(seen, G, group=ulysses_group)
        groups = [int(g) for g in seen]
        me = dist.get_rank(ulysses_group)
        # anchors in the gathered layout (member j's token a is row j*T + a), then in ring-shard order
        anchors = branches.anchors.long() + me * T
        anchors = AllToAll.apply(anchors.repeat(u), [len(anchors)] * u, groups, ulysses_group)
        inv = torch.empty_like(perm).index_copy(0, perm, torch.arange(len(perm), device=perm.device))
        ring_branches = Branches(
            *(_scatter_heads(x, groups, ulysses_group) for x in (branches.q, branches.k, branches.v)),
            inv[anchors],
            branches.inclusive,
            branches.mask,
        )
    res = ring_branch_attention(
        None if q is None else to_ring(q), to_ring(k), to_ring(v), ring_cu, ring_branches, ring_group, scale=scale
    )
    out = lse = bout = blse = None
    if q is not None:
        out, lse = from_ring(res.out), from_ring(res.lse)
    if branches is not None:
        n = branches.q.shape[0]
        bout = _gather_heads(res.branch_out, groups, n, ulysses_group)
        blse = _gather_heads(res.branch_lse[..., None], groups, n, ulysses_group)[..., 0]
    return AttentionOutput(out, lse, bout, blse)
