"""The dense reference: one explicit boolean mask over [main keys ; all branch-local keys].

Readable above all, any dtype, differentiable by plain autograd (including
through the LSE). Memory is O(H * (T + G*Qg) * (T + G*Kg)): for tests and
reference losses, not for training.
"""

import torch

from codraft.attention.branches import AttentionOutput, Branches, acc_dtype, default_scale


def sequence_ids(cu_seqlens: torch.Tensor, T: int) -> torch.Tensor:
    """[T] index of the packed sequence each token belongs to."""
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    return torch.repeat_interleave(torch.arange(len(lengths), device=cu_seqlens.device), lengths, output_size=T)


def branch_mask(cu_seqlens: torch.Tensor, T: int, branches: Branches | None) -> torch.Tensor:
    """[T + G*Qg, T + G*Kg] bool: which key (main, then branch-local group by group) each query sees."""
    seq = sequence_ids(cu_seqlens, T)
    pos = torch.arange(T, device=seq.device)
    main = (seq[:, None] == seq[None, :]) & (pos[None, :] <= pos[:, None])  # [T, T] causal per sequence
    if branches is None:
        return main
    G, Qg = branches.q.shape[:2]
    Kg = branches.k.shape[1]
    a = branches.anchors.to(seq.device).long()
    upto = pos[None, :] <= a[:, None] if branches.inclusive else pos[None, :] < a[:, None]
    prefix = (seq[a][:, None] == seq[None, :]) & upto  # [G, T] main keys of the anchor's sequence
    prefix = prefix[:, None, :].expand(G, Qg, T).reshape(G * Qg, T)
    local = branches.mask if branches.mask is not None else torch.ones(Qg, Kg, dtype=torch.bool)
    same_group = torch.eye(G, dtype=torch.bool, device=seq.device)
    local = same_group[:, None, :, None] & local.to(seq.device)[None, :, None, :]  # [G, Qg, G, Kg]
    local = local.reshape(G * Qg, G * Kg)
    no_branch_keys = torch.zeros(T, G * Kg, dtype=torch.bool, device=seq.device)
    return torch.cat([torch.cat([main, no_branch_keys], 1), torch.cat([prefix, local], 1)], 0)


def masked_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [Lq, H, D], k/v [Lk, Hkv, D], mask [Lq, Lk] bool -> out [Lq, H, D] (q.dtype), lse [Lq, H] (fp32/fp64).

    Rows with no visible key: out 0, lse -inf, zero gradients.
    """
    H, Hkv = q.shape[1], k.shape[1]
    dtype = acc_dtype(q.dtype)
    k = k.repeat_interleave(H // Hkv, dim=1)  # GQA: query head h uses kv head h // (H // Hkv)
    v = v.repeat_interleave(H // Hkv, dim=1)
    s = torch.einsum("qhd,khd->hqk", q.to(dtype), k.to(dtype)) * scale
    s = s.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)  # [H, Lq], -inf on rows with no visible key
    p = torch.exp(s - lse.masked_fill(lse == float("-inf"), 0.0)[..., None])  # those rows: all zeros
    out = torch.einsum("hqk,khd->qhd", p, v.to(dtype))
    return out.to(q.dtype), lse.transpose(0, 1)


def dense_branch_attention(
    q: torch.Tensor | None,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    branches: Branches | None = None,
    *,
    scale: float | None = None,
) -> AttentionOutput:
    T = k.shape[0]
    scale = default_scale(k, scale)
    mask = branch_mask(cu_seqlens, T, branches)
    if branches is None:
        return AttentionOutput(*masked_attention(q, k, v, mask, scale))
    G, Qg, H, D = branches.q.shape
    Hkv = k.shape[1]
    qa = branches.q.reshape(G * Qg, H, D)
    if q is None:  # branch queries only
        mask = mask[T:]
    else:
        qa = torch.cat([q, qa])
    ka = torch.cat([k, branches.k.reshape(-1, Hkv, D)])
    va = torch.cat([v, branches.v.reshape(-1, Hkv, D)])
    out, lse = masked_attention(qa, ka, va, mask, scale)
    T_q = 0 if q is None else T
    bout, blse = out[T_q:].reshape(G, Qg, H, D), lse[T_q:].reshape(G, Qg, H)
    if q is None:
        return AttentionOutput(None, None, bout, blse)
    return AttentionOutput(out[:T], lse[:T], bout, blse)
