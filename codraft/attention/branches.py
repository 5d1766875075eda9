"""The inputs and outputs of branch attention, shared by every implementation.

Layout is token-major and packed, with no batch dim: the main sequence holds T
tokens of N packed sequences (`cu_seqlens [N+1]`), causal within each sequence.
A branch group g has Qg queries and Kg branch-local keys; its queries see the
main keys of its anchor's sequence up to the anchor (inclusive or exclusive)
and the group's own branch-local keys under `mask`.
"""

from dataclasses import dataclass

import torch


@dataclass
class Branches:
    q: torch.Tensor  # [G, Qg, H, D]
    k: torch.Tensor  # [G, Kg, Hkv, D]
    v: torch.Tensor  # [G, Kg, Hkv, D]
    anchors: torch.Tensor  # [G] int, packed index into the main sequence
    inclusive: bool  # main keys at positions <= anchor (True, EAGLE-3 TTT) or < anchor (False, DFlash/DSpark)
    mask: torch.Tensor | None = None  # [Qg, Kg] bool, branch-local keys each query sees; None = all


@dataclass
class AttentionOutput:
    out: torch.Tensor | None  # [T, H, D], dtype of q; None when q is None (branch queries only)
    lse: torch.Tensor | None  # [T, H], fp32 (fp64 for fp64 inputs); -inf on rows that see no key
    branch_out: torch.Tensor | None = None  # [G, Qg, H, D]
    branch_lse: torch.Tensor | None = None  # [G, Qg, H]


def default_scale(q: torch.Tensor, scale: float | None) -> float:
    return q.shape[-1] ** -0.5 if scale is None else float(scale)


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Softmax statistics (LSE, merges, gradient sums) are kept in fp32, or fp64 for fp64 inputs."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def check_inputs(
    q: torch.Tensor | None, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, branches: Branches | None
) -> None:
    """Shape checks with the offending shapes in the message; cheap (a host read of cu_seqlens and anchors)."""
    if k.dim() != 3 or k.shape != v.shape:
        raise ValueError(f"expected k and v [T, Hkv, D]; got {tuple(k.shape)}, {tuple(v.shape)}")
    T, Hkv, D = k.shape
    if q is None and branches is None:
        raise ValueError("q may be None (no main queries) only when branches are given")
    if q is not None and (q.dim() != 3 or q.shape[0] != T or q.shape[2] != D or q.shape[1] % Hkv != 0):
        raise ValueError(f"q must be [T={T}, H, D={D}] with H a multiple of Hkv={Hkv}; got {tuple(q.shape)}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2 or cu_seqlens[0] != 0 or cu_seqlens[-1] != T:
        raise ValueError(f"cu_seqlens must be [N+1] from 0 to T={T}; got {cu_seqlens.tolist()}")
    if bool((cu_seqlens[1:] < cu_seqlens[:-1]).any()):
        raise ValueError(f"cu_seqlens must be non-decreasing; got {cu_seqlens.tolist()}")
    if branches is None:
        return
    b = branches
    H = b.q.shape[2] if q is None else q.shape[1]
    if b.q.dim() != 4 or b.q.shape[2:] != (H, D) or H % Hkv != 0:
        raise ValueError(
            f"branch q must be [G, Qg, H, D={D}] with H a multiple of Hkv={Hkv} (and H={H} if q is "
            f"given); got {tuple(b.q.shape)}"
        )
    G, Qg = b.q.shape[:2]
    if b.k.dim() != 4 or b.k.shape != b.v.shape or b.k.shape[0] != G or b.k.shape[2:] != (Hkv, D):
        raise ValueError(
            f"branch k/v must be [G={G}, Kg, Hkv={Hkv}, D={D}]; got {tuple(b.k.shape)}, {tuple(b.v.shape)}"
        )
    if b.anchors.shape != (G,) or b.anchors.dtype.is_floating_point or b.anchors.dtype == torch.bool:
        raise ValueError(f"anchors must be an int tensor [G={G}]; got {tuple(b.anchors.shape)} {b.anchors.dtype}")
    if G and (int(b.anchors.min()) < 0 or int(b.anchors.max()) >= T):
        raise ValueError(f"anchors must lie in [0, T={T})")
    if b.mask is not None and (b.mask.dtype != torch.bool or b.mask.shape != (Qg, b.k.shape[1])):
        raise ValueError(
            f"branch mask must be bool [Qg={Qg}, Kg={b.k.shape[1]}]; got {tuple(b.mask.shape)} {b.mask.dtype}"
        )
    for name, t in (("q", b.q), ("k", b.k), ("v", b.v)):
        if t.dtype != k.dtype or t.device != k.device:
            raise ValueError(f"branch {name} is {t.dtype} on {t.device}; main k is {k.dtype} on {k.device}")
