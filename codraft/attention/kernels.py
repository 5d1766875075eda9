"""Fused attention kernels with LSE: the only device-specific code of `codraft.attention`.

Every fused variant (local branch attention now, zigzag ring CP and USP later)
calls these two block functions and `causal_segments_*`; a GPU backend
(flash-attn varlen) is added here, by device, without touching the variants.

CPU kernel (torch 2.13, checked):
  aten::_scaled_dot_product_flash_attention_for_cpu(Tensor query, Tensor key, Tensor value, float dropout_p=0.,
      bool is_causal=False, *, Tensor? attn_mask=None, float? scale=None) -> (Tensor output, Tensor logsumexp)
  aten::_scaled_dot_product_flash_attention_for_cpu_backward(Tensor grad_out, Tensor query, Tensor key,
      Tensor value, Tensor out, Tensor logsumexp, float dropout_p, bool is_causal, *, Tensor? attn_mask=None,
      float? scale=None) -> (Tensor grad_query, Tensor grad_key, Tensor grad_value)
  - layout [B, H, L, D] with equal head counts; strided inputs are read as they are (a token-major
    [B, L, H, D] tensor passed as .transpose(1, 2) is not copied), stride-0 (expanded) heads work,
    BUT the last dim must have unit stride: the forward silently reads garbage otherwise (so does the
    backward for `out`; it copies grad_out itself). `_unit_last` guards every tensor input.
  - output is [B, H, L, D] laid out in memory as [B, L, H, D]; logsumexp is natural log, [B, H, L] laid
    out as [B, L, H], fp32 for fp32/bf16/fp16 inputs and fp64 for fp64 inputs (fp64 is supported).
  - is_causal is aligned top-left (query i sees keys j <= i).
  - attn_mask must be additive float (a bool mask is rejected in the forward and silently misread
    in the backward), broadcastable to [B, H, Lq, Lk]; a row masked entirely gives out 0 and lse 0
    (not -inf).
  - L = 0 (queries or keys) crashes the process with SIGFPE: never call it on empty blocks.
  - the backward recomputes P = exp(S - lse) from the lse it is given, and delta = rowsum(dO * out)
    from the out it is given; lse = -inf gives NaN, lse = +inf gives exact zero gradients.
"""

import torch

from codraft.attention.branches import acc_dtype

_cpu_fwd = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_cpu_bwd = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


def _check_device(q: torch.Tensor) -> None:
    if q.device.type != "cpu":
        raise NotImplementedError(
            f"fused attention has only a CPU backend so far (got {q.device.type} tensors); "
            "use impl='dense' until the flash-attn varlen backend lands in codraft/attention/kernels.py"
        )


def expand_kv(x: torch.Tensor, H: int) -> torch.Tensor:
    """[..., L, Hkv, D] -> [..., L, H, D], query head h reading kv head h // (H // Hkv).

    Materialises the expanded tensor when 1 < Hkv < H (the CPU kernel needs equal head counts and a
    grouped broadcast is not expressible as one stride); Hkv == 1 is a stride-0 view and Hkv == H
    the tensor itself, no copy. Callers that reuse K/V across calls expand once and pass H heads.
    """
    Hkv = x.shape[-2]
    if Hkv == H:
        return x
    if Hkv == 1:
        return x.expand(*x.shape[:-2], H, x.shape[-1])
    return x.repeat_interleave(H // Hkv, dim=-2)


def reduce_kv(dx: torch.Tensor, Hkv: int) -> torch.Tensor:
    """[..., L, H, D] gradient of expanded keys/values -> [..., L, Hkv, D], summed over each query group."""
    H, D = dx.shape[-2:]
    return dx if Hkv == H else dx.unflatten(-2, (Hkv, H // Hkv)).sum(-2)


def _unit_last(x: torch.Tensor) -> torch.Tensor:
    """The CPU kernel assumes a unit-stride head dim; copy only when it is not (a transposed projection)."""
    return x if x.stride(-1) == 1 else x.contiguous()


def _bias(mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """bool mask (True = visible) -> additive float mask in the query dtype, as the kernel requires."""
    if mask is None:
        return None
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, float("-inf"))


def attn_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float,
    causal: bool = False,
    mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One block of attention with its LSE.

    q [B, Lq, H, D], k/v [B, Lk, Hkv, D], mask bool broadcastable to [B, 1, Lq, Lk] (True = visible).
    causal requires Lq == Lk (so top-left and bottom-right alignment agree across backends).
    Returns out [B, Lq, H, D] in q.dtype and lse [B, Lq, H] in fp32 (fp64 for fp64 inputs);
    rows that see no key get out 0, lse -inf.
    """
    _check_device(q)
    B, Lq, H, D = q.shape
    Lk = k.shape[1]
    assert not causal or Lq == Lk, f"causal blocks must be square, got Lq={Lq}, Lk={Lk}"
    if B == 0 or Lq == 0 or Lk == 0:  # the CPU kernel crashes on empty blocks
        return q.new_zeros(B, Lq, H, D), q.new_full((B, Lq, H), float("-inf"), dtype=acc_dtype(q.dtype))
    out, lse = _cpu_fwd(
        _unit_last(q).transpose(1, 2),
        _unit_last(expand_kv(k, H)).transpose(1, 2),
        _unit_last(expand_kv(v, H)).transpose(1, 2),
        0.0,
        causal,
        attn_mask=_bias(mask, q.dtype),
        scale=scale,
    )
    out, lse = out.transpose(1, 2), lse.transpose(1, 2)  # contiguous [B, Lq, H, D], [B, Lq, H]
    if mask is not None:  # the kernel reports lse 0 for fully masked rows
        empty = (~mask.any(-1)).expand(B, 1, Lq).reshape(B, Lq, 1)
        lse = lse.masked_fill(empty, float("-inf"))
    return out, lse


def attn_bwd(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    *,
    scale: float,
    causal: bool = False,
    mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of one block, given the FINAL out [B, Lq, H, D] and lse [B, Lq, H] of its query rows.

    With the final statistics (after merging every key block) the kernel's P = exp(S - lse) and
    delta = rowsum(dO * out) are those of the full softmax, so the block's dQ, dK, dV are exactly
    its share of the full gradient (see fused.py). Returns dq [B, Lq, H, D], dk/dv [B, Lk, Hkv, D]
    in the input dtypes; rows with lse = -inf get zero gradients.
    """
    _check_device(q)
    B, Lq, H, D = q.shape
    Lk, Hkv = k.shape[1], k.shape[2]
    if B == 0 or Lq == 0 or Lk == 0:
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    lse = lse.masked_fill(lse == float("-inf"), float("inf"))  # exp(S - inf) = 0: no NaN, zero grads
    dq, dk, dv = _cpu_bwd(
        _unit_last(dout).transpose(1, 2),
        _unit_last(q).transpose(1, 2),
        _unit_last(expand_kv(k, H)).transpose(1, 2),
        _unit_last(expand_kv(v, H)).transpose(1, 2),
        _unit_last(out.to(q.dtype)).transpose(1, 2),
        lse.to(acc_dtype(q.dtype)).transpose(1, 2),
        0.0,
        causal,
        attn_mask=_bias(mask, q.dtype),
        scale=scale,
    )
    return dq.transpose(1, 2), reduce_kv(dk.transpose(1, 2), Hkv), reduce_kv(dv.transpose(1, 2), Hkv)


# A causal segment (q0, k0, n): queries q0..q0+n-1 attend causally to keys k0..k0+n-1 (query i to
# keys <= i). The packed causal attention of N sequences is N segments with q0 == k0; query rows in
# no segment see no key. A flash-attn varlen backend turns a segment list into one call.
Segment = tuple[int, int, int]


def causal_segments_fwd(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segments: list[Segment], *, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [Tq, H, D], k/v [Tk, Hkv, D] -> out [Tq, H, D] (q.dtype), lse [Tq, H] (fp32/fp64)."""
    Tq, H, D = q.shape
    k, v = expand_kv(k, H), expand_kv(v, H)  # once for all segments
    out = q.new_zeros(Tq, H, D)
    lse = q.new_full((Tq, H), float("-inf"), dtype=acc_dtype(q.dtype))
    for q0, k0, n in segments:
        o, lse_ = attn_fwd(q[None, q0 : q0 + n], k[None, k0 : k0 + n], v[None, k0 : k0 + n], scale=scale, causal=True)
        out[q0 : q0 + n], lse[q0 : q0 + n] = o[0], lse_[0]
    return out, lse


def causal_segments_bwd(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    segments: list[Segment],
    *,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of `causal_segments_fwd` given the final out/lse; dq [Tq, H, D], dk/dv [Tk, Hkv, D] in fp32
    (fp64 for fp64 inputs), zero outside the segments. Segments must not share key rows."""
    H, Hkv = q.shape[1], k.shape[1]
    k, v = expand_kv(k, H), expand_kv(v, H)  # once for all segments
    dtype = acc_dtype(q.dtype)
    dq = torch.zeros(q.shape, dtype=dtype, device=q.device)
    dk = torch.zeros(k.shape, dtype=dtype, device=k.device)
    dv = torch.zeros(v.shape, dtype=dtype, device=v.device)
    for q0, k0, n in segments:
        rq, rk = slice(q0, q0 + n), slice(k0, k0 + n)
        gq, gk, gv = attn_bwd(
            dout[None, rq],
            q[None, rq],
            k[None, rk],
            v[None, rk],
            out[None, rq],
            lse[None, rq],
            scale=scale,
            causal=True,
        )
        dq[rq], dk[rk], dv[rk] = gq[0], gk[0], gv[0]
    return dq, reduce_kv(dk, Hkv), reduce_kv(dv, Hkv)
