"""Zigzag ring branch attention: context-parallel `branch_attention` over a CP group.

Inputs are one rank's zigzag shard (see cp_shard.py): every local sequence is [chunk r ; chunk 2cp-1-r]
of its padded sequence, so its 2c local tokens are in position order and every rank has the same local
cu_seqlens. Main K/V (Hkv heads, no GQA repeat on the wire) rotate round the ring; at step s a rank
holds the block of source rank src = (r - s) mod cp and attends what its queries may see of it:

  s == 0     local causal, per sequence (the two local chunks are in position order);
  src < r    chunk src precedes both local chunks: all local queries vs the FIRST half of the block;
  src > r    the block lies after chunk r and before chunk 2cp-1-r: the SECOND half of the local
             queries vs the whole block.

Branch queries follow the same schedule using their anchor's position: a group anchored at position
p sees the main keys of its sequence at positions < p + 1 (inclusive) or < p (exclusive). A received
block is in position order too, so whatever a group sees of it is a prefix: n = clamp(limit - src*c,
0, c) + clamp(limit - (2cp-1-src)*c, 0, c) keys. Main queries are the special case of one query per
group anchored at itself (inclusive), and for them n reduces to exactly the three cases above. The
kernel calls per step are therefore the fused op's prefix calls (fused.py): one per sequence, masked
only where groups of a sequence see prefixes of different lengths. Branch-local K/V never leave the
rank: attended once, at step 0 while the first block is in flight. All partials merge in fp32 with
`merge_attention`.

Backward: K/V rotate again; each block's gradient comes from the kernel backward called with the FINAL
out and LSE (exact shares of the whole softmax's gradient, see fused.py). dQ stays local; dK/dV of the
block held at step s accumulate in an fp32 buffer that travels one hop per step with the block's
holders, so after cp hops it arrives at the block's owner.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch
import torch.distributed as dist
from torch import nn

from codraft.attention.branches import AttentionOutput, Branches, acc_dtype, check_inputs, default_scale
from codraft.attention.fused import (
    Plan,
    causal_segments,
    is_ttt_shape,
    prefix_bwd,
    prefix_calls,
    prefix_fwd,
    refuse_lse_grad,
)
from codraft.attention.kernels import attn_bwd, attn_fwd, expand_kv, reduce_kv
from codraft.attention.merge import merge_attention

KV_TAG, GRAD_TAG = 0, 1  # K/V and dK/dV hops can be in flight between the same two ranks at once


class Ring:
    """Point-to-point hops round a process group: send to group rank r+1, receive from r-1."""

    def __init__(self, group: dist.ProcessGroup | None):
        self.group = group
        self.size = 1 if group is None else dist.get_world_size(group)
        self.rank = 0 if group is None else dist.get_rank(group)

    def send_recv(self, x: torch.Tensor, tag: int) -> tuple[torch.Tensor, list]:
        """Post the hop of x and return (receive buffer, pending work); a ring of one is its own neighbour."""
        if self.size == 1:
            return x, []
        recv = torch.empty_like(x)
        nxt, prev = (self.rank + 1) % self.size, (self.rank - 1) % self.size
        ops = [
            dist.P2POp(dist.isend, x, group=self.group, tag=tag, group_peer=nxt),
            dist.P2POp(dist.irecv, recv, group=self.group, tag=tag, group_peer=prev),
        ]
        return recv, dist.batch_isend_irecv(ops)

    @staticmethod
    def wait(pending: tuple[torch.Tensor, list]) -> torch.Tensor:
        recv, works = pending
        for w in works:
            w.wait()
        return recv


@dataclass
class RingPlan:
    """Host-side schedule of every ring step, shared by forward and backward."""

    scale: float
    main: list[Plan] | None  # per step: main queries as one-query groups anchored at themselves
    branch: list[Plan] | None  # per step: the branch groups
    local_mask: torch.Tensor | None  # [Qg, Kg] bool


def step_plans(
    cu: list[int], anchors: torch.Tensor, Qg: int, inclusive: bool, rank: int, cp: int, scale: float, device
) -> list[Plan]:
    """The kernel calls of groups anchored at local packed indices `anchors` [G], for each ring step."""
    cu_t = torch.tensor(cu)
    seq = torch.searchsorted(cu_t, anchors, right=True) - 1
    offset, c = anchors - cu_t[seq], (cu_t.diff() // 2)[seq]
    pos = torch.where(offset < c, rank * c + offset, (2 * cp - 1 - rank) * c + offset - c)  # global positions
    limit = pos + 1 if inclusive else pos  # the group sees main positions < limit
    plans = []
    for s in range(cp):
        src = (rank - s) % cp
        if s == 0 and is_ttt_shape(anchors, Qg, cu[-1]):  # local causal, as on one device
            plans.append(Plan(scale, [], prefix_segments=causal_segments(cu, 0 if inclusive else 1)))
            continue
        # the block from src is [chunk src ; chunk 2cp-1-src] per sequence: what a group sees is a prefix
        # (main queries: src < r gives c keys to all; src > r none to the first half, 2c to the second)
        n = (limit - src * c).clamp(min=0).minimum(c) + (limit - (2 * cp - 1 - src) * c).clamp(min=0).minimum(c)
        plans.append(Plan(scale, [], prefix_calls=prefix_calls(cu, seq, n, Qg, device)))
    return plans


def ring_plan(
    cu_seqlens: torch.Tensor, has_main: bool, branches: Branches | None, ring: Ring, scale: float
) -> RingPlan:
    cu = cu_seqlens.tolist()
    lengths = cu_seqlens.diff()
    if bool((lengths % 2).any()):
        raise ValueError(
            f"local cu_seqlens must hold two zigzag chunks per sequence (even lengths); got lengths {lengths.tolist()}"
        )
    plans = partial(step_plans, cu, rank=ring.rank, cp=ring.size, scale=scale)
    main = plans(torch.arange(cu[-1]), 1, True, device=cu_seqlens.device) if has_main else None
    if branches is None:
        return RingPlan(scale, main, None, None)
    anchors = branches.anchors.cpu().long()
    branch = plans(anchors, branches.q.shape[1], branches.inclusive, device=branches.q.device)
    return RingPlan(scale, main, branch, branches.mask)


class RingBranchAttentionFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, bq, bk, bv, plan: RingPlan, ring: Ring):
        # q [T, H, D] or None, k/v [T, Hkv, D]; bq [G, Qg, H, D], bk/bv [G, Kg, Hkv, D] or all None
        H = (bq if q is None else q).shape[-2]
        out = lse = bout = blse = None
        kv = torch.stack([k, v])  # [2, T, Hkv, D], the block that travels
        for s in range(ring.size):
            if s + 1 < ring.size:
                nxt = ring.send_recv(kv, KV_TAG)  # the next block is in flight while this one is computed
            ke, ve = expand_kv(kv[0], H), expand_kv(kv[1], H)  # [T, H, D], for the kernel only
            if q is not None:
                o, l = prefix_fwd(q[:, None], ke, ve, plan.main[s])
                out, lse = (o[:, 0], l[:, 0]) if s == 0 else merge_attention(out, lse, o[:, 0], l[:, 0])
            if bq is not None:
                o, l = prefix_fwd(bq, ke, ve, plan.branch[s])
                bout, blse = (o, l) if s == 0 else merge_attention(bout, blse, o, l)
                if s == 0:  # branch-local keys never leave this rank: attended once
                    o, l = attn_fwd(bq, bk, bv, scale=plan.scale, mask=plan.local_mask)
                    bout, blse = merge_attention(bout, blse, o, l)
            if s + 1 < ring.size:
                kv = ring.wait(nxt)
        if q is not None:
            out = out.to(q.dtype)
        if bq is not None:
            bout = bout.to(bq.dtype)
        ctx.plan, ctx.ring = plan, ring
        ctx.save_for_backward(q, k, v, bq, bk, bv, out, lse, bout, blse)
        ctx.set_materialize_grads(False)
        return out, lse, bout, blse

    @staticmethod
    def backward(ctx, dout, dlse, dbout, dblse):
        refuse_lse_grad("ring", dlse, dblse)
        q, k, v, bq, bk, bv, out, lse, bout, blse = ctx.saved_tensors
        plan: RingPlan = ctx.plan
        ring: Ring = ctx.ring
        dtype = acc_dtype(k.dtype)
        H, Hkv = (bq if q is None else q).shape[-2], k.shape[1]
        main = q is not None and dout is not None
        branch = bq is not None and dbout is not None
        dq = None if q is None else torch.zeros(q.shape, dtype=dtype, device=q.device)
        dbq = dbk = dbv = None
        if bq is not None:
            dbq = torch.zeros(bq.shape, dtype=dtype, device=bq.device)
            dbk, dbv = torch.zeros_like(bk), torch.zeros_like(bv)
        kv = torch.stack([k, v])
        dkv_in = None  # the gradient of the block held now, as its earlier holders left it
        for s in range(ring.size):
            if s + 1 < ring.size:
                nxt = ring.send_recv(kv, KV_TAG)
            ke, ve = expand_kv(kv[0], H), expand_kv(kv[1], H)
            dk = torch.zeros(ke.shape, dtype=dtype, device=k.device)  # this step's share, expanded heads [T, H, D]
            dv = torch.zeros(ve.shape, dtype=dtype, device=v.device)
            if main:  # main queries as one-query groups: [T, 1, H, D] views
                rows = (dout[:, None], q[:, None], ke, ve, out[:, None], lse[:, None])
                prefix_bwd(*rows, plan.main[s], dq[:, None], dk, dv)
            if branch:
                prefix_bwd(dbout, bq, ke, ve, bout, blse, plan.branch[s], dbq, dk, dv)
                if s == 0:
                    gq, dbk, dbv = attn_bwd(dbout, bq, bk, bv, bout, blse, scale=plan.scale, mask=plan.local_mask)
                    dbq += gq
            dkv = torch.stack([reduce_kv(dk, Hkv), reduce_kv(dv, Hkv)])  # [2, T, Hkv, D] fp32
            if dkv_in is not None:
                dkv += ring.wait(dkv_in)
            dkv_in = ring.send_recv(dkv, GRAD_TAG)  # on to the block's next holder (after cp hops: its owner)
            if s + 1 < ring.size:
                kv = ring.wait(nxt)
        dkv = ring.wait(dkv_in)  # the gradient of this rank's own K/V, home
        dq = None if dq is None else dq.to(q.dtype)
        dbq = None if dbq is None else dbq.to(bq.dtype)
        return dq, dkv[0].to(k.dtype), dkv[1].to(v.dtype), dbq, dbk, dbv, None, None


def ring_branch_attention(
    q: torch.Tensor | None,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    branches: Branches | None,
    group: dist.ProcessGroup | None,
    *,
    scale: float | None = None,
) -> AttentionOutput:
    """`branch_attention` on a zigzag CP shard (cp_shard.py): the same contract, with local tensors.

    q [T, H, D] or None, k/v [T, Hkv, D], cu_seqlens [N+1] local (two chunks per sequence, equal on every
    rank); branches with anchors as LOCAL packed indices (cp_shard's `route`; TTT: one per local token).
    Collective over `group` (None: a single rank, the fused op's result), in the forward and in the
    backward: every rank of the group calls it and backpropagates through it.
    """
    check_inputs(q, k, v, cu_seqlens, branches)
    ring = Ring(group)
    plan = ring_plan(cu_seqlens, q is not None, branches, ring, default_scale(k, scale))
    bq, bk, bv = (None, None, None) if branches is None else (branches.q, branches.k, branches.v)
    return AttentionOutput(*RingBranchAttentionFn.apply(q, k, v, bq, bk, bv, plan, ring))


def ring_causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, cp_group: dist.ProcessGroup | None
) -> torch.Tensor:
    """The policy's packed causal attention under CP, a drop-in for `Attention.packed_attention`
    (bind the group): q [T, H, D], k/v [T, Hkv, D] of the local shard -> out [T, H, D]."""
    return ring_branch_attention(q, k, v, cu_seqlens, None, cp_group).out


def apply_cp(model: nn.Module, parallel_dims) -> nn.Module:
    """Swap every attention layer of the policy to zigzag ring attention over the CP group (in place).

    The caller feeds the zigzag shard: input ids, `position_ids` (global, for RoPE) and the local
    cu_seqlens from `cp_shard.shard_batch`. cp == 1 leaves the model as it is.
    """
    from codraft.models.model import Attention  # the policy is heavier than this module needs

    if parallel_dims.cp == 1:
        return model
    attention = partial(ring_causal_attention, cp_group=parallel_dims.cp_group)
    for module in model.modules():
        if isinstance(module, Attention):
            module.packed_attention = attention
    return model
