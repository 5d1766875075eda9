"""Fused branch attention on one device: main, branch-prefix and branch-local parts as kernel calls.

Main queries: one causal kernel call per packed sequence. Branch queries: two partials,
merged in fp32 with `merge_attention`:
  prefix  the anchor's sequence prefix (main keys up to the anchor), non-causal over it;
  local   the group's own branch-local keys under the group mask (all groups in one call).
The EAGLE-3 TTT shape (one query per group, group t anchored at main position t) makes the
prefix part a causal call of the branch queries over each sequence (shifted by one for
exclusive anchors) instead of T tiny calls. Otherwise groups are batched per sequence: one
call over the longest prefix, with a key mask that cuts each group at its own anchor.

Backward (the ring-attention trick): each partial's backward is the kernel's backward called
with the FINAL merged out O and LSE L. For a query row, P_j = exp(s_j - L) over all keys j of
all partials, dS_j = P_j (dO . v_j - delta) with delta = dO . O = sum_j P_j (dO . v_j) over ALL
keys; the kernel recomputes exactly these P_j and delta from the (O, L) it is given, so each
partial's dQ, dK, dV is its exact share of the gradient of the whole softmax.
"""

from dataclasses import dataclass

import torch

from codraft.attention.branches import AttentionOutput, Branches, acc_dtype, default_scale
from codraft.attention.kernels import (
    Segment,
    attn_bwd,
    attn_fwd,
    causal_segments_bwd,
    causal_segments_fwd,
    expand_kv,
    reduce_kv,
)
from codraft.attention.merge import merge_attention


@dataclass
class PrefixCall:
    """The groups anchored in one sequence, attending its first `length` main keys from k0."""

    groups: torch.Tensor | slice  # [n] group indices (a slice when contiguous: no gather), each with keys to see
    k0: int
    length: int  # the longest prefix among these groups
    mask: torch.Tensor | None  # [n * Qg, length] bool, key j < the row's own prefix length; None if all equal

    @property
    def n(self) -> int:
        g = self.groups
        return g.stop - g.start if isinstance(g, slice) else len(g)


@dataclass
class Plan:
    """Host-side schedule of the kernel calls, built once from cu_seqlens and the anchors."""

    scale: float
    main: list[Segment]
    prefix_segments: list[Segment] | None = None  # TTT shape: causal segments of branch queries over main keys
    prefix_calls: list[PrefixCall] | None = None  # otherwise: one masked call per sequence
    local_mask: torch.Tensor | None = None  # [Qg, Kg] bool


def causal_segments(cu: list[int], shift: int = 0) -> list[Segment]:
    """Each packed sequence's queries over its own keys, query i seeing keys <= i - shift (1: exclusive)."""
    return [(s + shift, s, e - s - shift) for s, e in zip(cu[:-1], cu[1:], strict=True) if e - s > shift]


def is_ttt_shape(anchors: torch.Tensor, Qg: int, T: int) -> bool:
    """EAGLE-3 TTT: one query per group, group t anchored at main position t."""
    return Qg == 1 and anchors.numel() == T and torch.equal(anchors.cpu(), torch.arange(T))


def prefix_calls(
    cu: list[int], seq: torch.Tensor, lengths: torch.Tensor, Qg: int, device: torch.device
) -> list[PrefixCall]:
    """Groups batched per sequence: group g sees main keys cu[seq[g]] .. cu[seq[g]] + lengths[g] - 1.

    seq/lengths [G] int on the host. Groups with no key to see are left out of every call.
    """
    keep = torch.nonzero(lengths > 0).flatten()
    keep = keep[torch.argsort(seq[keep], stable=True)]  # grouped by sequence, increasing within one
    seqs, counts = torch.unique_consecutive(seq[keep], return_counts=True)
    calls = []
    for i, gs in zip(seqs.tolist(), torch.split(keep, counts.tolist()), strict=True):
        n_keys = lengths[gs]
        length = int(n_keys.max())
        mask = None
        if int(n_keys.min()) != length:
            mask = torch.arange(length)[None, :] < n_keys[:, None]  # [n, length]
            mask = mask.repeat_interleave(Qg, dim=0).to(device)  # [n * Qg, length]
        g0, n = int(gs[0]), len(gs)
        groups = slice(g0, g0 + n) if int(gs[-1]) - g0 + 1 == n else gs.to(device)
        calls.append(PrefixCall(groups, cu[i], length, mask))
    return calls


def build_plan(cu_seqlens: torch.Tensor, branches: Branches | None, scale: float) -> Plan:
    cu = cu_seqlens.tolist()
    plan = Plan(scale, causal_segments(cu))
    if branches is None:
        return plan
    plan.local_mask = branches.mask
    Qg = branches.q.shape[1]
    shift = 0 if branches.inclusive else 1
    anchors = branches.anchors.cpu().long()
    if is_ttt_shape(anchors, Qg, cu[-1]):
        plan.prefix_segments = causal_segments(cu, shift)
        return plan
    seq = torch.searchsorted(cu_seqlens.cpu(), anchors, right=True) - 1
    lengths = anchors - cu_seqlens.cpu()[seq] + 1 - shift  # an exclusive anchor at a sequence start sees no key
    plan.prefix_calls = prefix_calls(cu, seq, lengths, Qg, branches.q.device)
    return plan


def prefix_fwd(bq: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: Plan) -> tuple[torch.Tensor, torch.Tensor]:
    """Branch queries [G, Qg, H, D] over their anchors' main prefixes -> out [G, Qg, H, D], lse [G, Qg, H]."""
    G, Qg, H, D = bq.shape
    if plan.prefix_segments is not None:
        out, lse = causal_segments_fwd(bq[:, 0], k, v, plan.prefix_segments, scale=plan.scale)
        return out[:, None], lse[:, None]
    out = bq.new_zeros(G, Qg, H, D)
    lse = bq.new_full((G, Qg, H), float("-inf"), dtype=acc_dtype(bq.dtype))
    for c in plan.prefix_calls:
        n, keys = c.n, slice(c.k0, c.k0 + c.length)
        o, lse_ = attn_fwd(
            bq[c.groups].reshape(1, n * Qg, H, D), k[None, keys], v[None, keys], scale=plan.scale, mask=c.mask
        )
        out[c.groups], lse[c.groups] = o.view(n, Qg, H, D), lse_.view(n, Qg, H)
    return out, lse


def prefix_bwd(dbout, bq, k, v, bout, blse, plan: Plan, dbq, dk, dv) -> None:
    """Accumulates the prefix part's gradients into dbq [G, Qg, H, D] and dk/dv [T, H, D] of the H-head main K/V
    it is given (fp32/fp64 buffers)."""
    G, Qg, H, D = bq.shape
    if plan.prefix_segments is not None:
        g = causal_segments_bwd(
            dbout[:, 0], bq[:, 0], k, v, bout[:, 0], blse[:, 0], plan.prefix_segments, scale=plan.scale
        )
        dbq[:, 0] += g[0]
        dk += g[1]
        dv += g[2]
        return
    for c in plan.prefix_calls:
        n, keys = c.n, slice(c.k0, c.k0 + c.length)
        rows = (1, n * Qg, H, D)
        gq, gk, gv = attn_bwd(
            dbout[c.groups].reshape(rows),
            bq[c.groups].reshape(rows),
            k[None, keys],
            v[None, keys],
            bout[c.groups].reshape(rows),
            blse[c.groups].reshape(1, n * Qg, H),
            scale=plan.scale,
            mask=c.mask,
        )
        dbq[c.groups] += gq.view(n, Qg, H, D)
        dk[keys] += gk[0]
        dv[keys] += gv[0]


class BranchAttentionFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, bq, bk, bv, plan: Plan):
        # q [T, H, D] or None, k/v [T, Hkv, D]; bq [G, Qg, H, D], bk/bv [G, Kg, Hkv, D] or all None
        out = lse = bout = blse = None
        H = (bq if q is None else q).shape[-2]
        ke, ve = expand_kv(k, H), expand_kv(v, H)  # [T, H, D], shared by the main and prefix calls
        if q is not None:
            out, lse = causal_segments_fwd(q, ke, ve, plan.main, scale=plan.scale)
        if bq is not None:
            pre_out, pre_lse = prefix_fwd(bq, ke, ve, plan)
            loc_out, loc_lse = attn_fwd(bq, bk, bv, scale=plan.scale, mask=plan.local_mask)
            bout, blse = merge_attention(pre_out, pre_lse, loc_out, loc_lse)  # fp32 (fp64)
            bout = bout.to(bq.dtype)
        ctx.plan = plan
        ctx.save_for_backward(q, k, v, bq, bk, bv, out, lse, bout, blse)
        ctx.set_materialize_grads(False)
        return out, lse, bout, blse

    @staticmethod
    def backward(ctx, dout, dlse, dbout, dblse):
        refuse_lse_grad("fused", dlse, dblse)
        q, k, v, bq, bk, bv, out, lse, bout, blse = ctx.saved_tensors
        plan: Plan = ctx.plan
        dtype = acc_dtype(k.dtype)
        dq = dbq = dbk = dbv = None
        H, Hkv = (bq if q is None else q).shape[-2], k.shape[1]
        ke, ve = expand_kv(k, H), expand_kv(v, H)
        dk = torch.zeros(ke.shape, dtype=dtype, device=k.device)  # gradients of the expanded K/V, [T, H, D]
        dv = torch.zeros(ve.shape, dtype=dtype, device=v.device)
        if q is not None and dout is not None:
            dq, dk_, dv_ = causal_segments_bwd(dout, q, ke, ve, out, lse, plan.main, scale=plan.scale)
            dk += dk_
            dv += dv_
            dq = dq.to(q.dtype)
        elif q is not None:
            dq = torch.zeros_like(q)
        if bq is not None:
            if dbout is None:
                dbq, dbk, dbv = torch.zeros_like(bq), torch.zeros_like(bk), torch.zeros_like(bv)
            else:
                dbq = torch.zeros(bq.shape, dtype=dtype, device=bq.device)
                prefix_bwd(dbout, bq, ke, ve, bout, blse, plan, dbq, dk, dv)
                gq, dbk, dbv = attn_bwd(dbout, bq, bk, bv, bout, blse, scale=plan.scale, mask=plan.local_mask)
                dbq = (dbq + gq).to(bq.dtype)
        dk, dv = reduce_kv(dk, Hkv).to(k.dtype), reduce_kv(dv, Hkv).to(v.dtype)
        return dq, dk, dv, dbq, dbk, dbv, None


def refuse_lse_grad(op: str, *grads: torch.Tensor | None) -> None:
    """The block backwards take the final LSE as given, so no gradient may flow through it."""
    if any(d is not None and bool(d.any()) for d in grads):
        raise NotImplementedError(f"{op} attention does not backpropagate through the LSE; use impl='dense'")


def fused_branch_attention(
    q: torch.Tensor | None,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    branches: Branches | None = None,
    *,
    scale: float | None = None,
) -> AttentionOutput:
    plan = build_plan(cu_seqlens, branches, default_scale(k, scale))
    bq, bk, bv = (None, None, None) if branches is None else (branches.q, branches.k, branches.v)
    out, lse, bout, blse = BranchAttentionFn.apply(q, k, v, bq, bk, bv, plan)
    return AttentionOutput(out, lse, bout, blse)
