"""The log-sum-exp merge of two partial attention results over disjoint key sets.

Shared by every attention variant: fused branch attention merges the main-prefix
and branch-local partials, the ring merges one block per step.
"""

import torch


def merge_attention(
    out1: torch.Tensor, lse1: torch.Tensor, out2: torch.Tensor, lse2: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over keys A | B from the softmaxes over A and over B.

    out* [..., D], lse* [...] (natural log; -inf on rows that saw no key).
    Returns (out, lse) in fp32, or fp64 if any input is fp64. Rows that saw no
    key on either side stay out = 0, lse = -inf (no NaN).
    """
    dtype = torch.promote_types(torch.promote_types(lse1.dtype, lse2.dtype), torch.float32)
    dtype = torch.promote_types(dtype, torch.promote_types(out1.dtype, out2.dtype))
    l1, l2 = lse1.to(dtype), lse2.to(dtype)
    m = torch.maximum(l1, l2)
    m = m.masked_fill(m == float("-inf"), 0.0)  # both empty: weights below become exp(-inf) = 0
    w1, w2 = torch.exp(l1 - m), torch.exp(l2 - m)
    w = w1 + w2  # in [1, 2] unless the row saw no key (then 0)
    empty = w == 0
    w = w.masked_fill(empty, 1.0)
    out = (w1[..., None] * out1.to(dtype) + w2[..., None] * out2.to(dtype)) / w[..., None]
    lse = (m + torch.log(w)).masked_fill(empty, float("-inf"))
    return out, lse
