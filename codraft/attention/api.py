"""`branch_attention`: one interface, two implementations (dense reference, fused kernels)."""

from typing import Literal

import torch

from codraft.attention.branches import AttentionOutput, Branches, check_inputs
from codraft.attention.dense import dense_branch_attention
from codraft.attention.fused import fused_branch_attention


def branch_attention(
    q: torch.Tensor | None,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    branches: Branches | None = None,
    *,
    impl: Literal["dense", "fused"] = "fused",
    scale: float | None = None,
) -> AttentionOutput:
    """Packed causal attention of the main queries plus branch attention of the branch groups.

    q [T, H, D] (or None: branch queries only, saves the main pass, e.g. EAGLE-3 TTT steps >= 1),
    k/v [T, Hkv, D], cu_seqlens [N+1] int. Main query t sees main keys of its sequence at positions
    <= t. Branch group g sees main keys of its anchor's sequence up to the anchor (see `Branches`)
    and its own branch-local keys under `branches.mask`. scale defaults to 1/sqrt(D).
    Rows that see no key: out 0, lse -inf, zero gradients. Differentiable w.r.t. every q/k/v; the
    fused implementation does not backpropagate through the returned LSE (it raises if asked).
    """
    check_inputs(q, k, v, cu_seqlens, branches)
    if impl == "dense":
        return dense_branch_attention(q, k, v, cu_seqlens, branches, scale=scale)
    if impl == "fused":
        return fused_branch_attention(q, k, v, cu_seqlens, branches, scale=scale)
    raise ValueError(f"impl must be 'dense' or 'fused'; got {impl!r}")


def causal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    impl: Literal["dense", "fused"] = "fused",
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The policy's packed causal attention: q [T, H, D], k/v [T, Hkv, D] -> out [T, H, D], lse [T, H]."""
    res = branch_attention(q, k, v, cu_seqlens, impl=impl, scale=scale)
    return res.out, res.lse
