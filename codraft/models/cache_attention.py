"""Attention of a few new queries per row over a KV cache (decode, verify and draft steps).

Those steps bring 1-16 queries per row. Where codraft's CPU kernels load, fp32 steps run their `cache_attention`
(cpu_kernels.cpp): one query at a time, so a query's output is bitwise the same in a decode step and in a verify
forward, alone or in a batch. Matmuls over the grouped queries (below) give a decode step's and a verify's query
outputs ~1e-7 apart, which bf16 activations (`cpu_kernels.bf16_gemm`) would round into whole bf16 steps. Alone
on contiguous keys the kernel took 0.6-1.4x their time (SmolLM2's heads, 200 keys: faster at 32 rows, slower at 1-8
rows x 4-8 queries); in the model, where the matmuls copy the cache's strided columns, whole forwards ran 0.85-0.97x
(stop 63, in-process A/B). Elsewhere: PyTorch's CPU flash kernel splits its work by (row, head, query
block), so with a handful of queries most of its time is overhead: for SmolLM2's heads (9 query heads over 3
KV heads, 150 keys) it took 2-3x as long at 8-32 rows and 2-8 queries as putting the query heads that share a
KV head into one matrix and running two batched matmuls (measured on this project's 2-core CPU; equal at one
row and one query). Longer query blocks (prefill: 26 ms against 12.5 ms at 32 x 100 queries), other devices
and other dtypes stay on SDPA: the grouped matmuls would take bf16/fp16 scores and softmax in that dtype, where
SDPA accumulates in fp32.

The mask is built once per forward and serves every layer: an additive bias in the grouped layout, or the
boolean mask SDPA takes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from codraft.models import cpu_kernels
from codraft.models.args import ModelArgs

MAX_GROUPED_QUERIES = 16  # queries per row up to which the grouped matmuls run


class CacheMask:
    """Which keys each query sees, in the form the forward's attention reads.

    visible: [B, S or 1, L] bool (1 broadcasts over the S queries); S queries per row attend with `num_heads`
    heads of `head_dim` over `num_kv_heads` key heads.
    """

    def __init__(self, visible: torch.Tensor, num_queries: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype):
        B, _, L = visible.shape
        few = num_queries <= MAX_GROUPED_QUERIES and visible.device.type == "cpu" and dtype == torch.float32
        self.kernel = few and head_dim <= cpu_kernels.MAX_HEAD_DIM and cpu_kernels.cpu_kernels() is not None
        self.grouped = few and not self.kernel
        self.visible = visible[:, None]  # [B, 1, S|1, L] for SDPA
        self.bytes = visible.to(torch.uint8).contiguous() if self.kernel else None  # [B, S|1, L] for the kernel
        self.bias = None
        if self.grouped:  # [B * Hkv, G * S, L]: row (g, s) of KV head j is query head j * G + g at query s
            groups = num_heads // num_kv_heads
            bias = torch.zeros(visible.shape, dtype=dtype, device=visible.device).masked_fill_(~visible, -torch.inf)
            bias = bias[:, None, None].expand(B, num_kv_heads, groups, num_queries, L)
            self.bias = bias.reshape(B * num_kv_heads, groups * num_queries, L)


def cache_mask(visible: torch.Tensor, num_queries: int, args: ModelArgs, dtype: torch.dtype) -> CacheMask:
    """The mask of a forward's attention over a cache, built once and read by every layer, for a model (policy or
    draft layer) of `args`: visible [B, S or 1, L] bool."""
    return CacheMask(visible, num_queries, args.num_heads, args.num_kv_heads, args.head_dim, dtype)


def cache_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: CacheMask) -> torch.Tensor:
    """q [B, H, S, D]; keys/values [B, Hkv, L, D] (a cache's columns, strided views are fine) -> [B, H, S, D]."""
    if mask.kernel:
        return cpu_kernels.cache_attention(q, keys, values, mask.bytes)
    if not mask.grouped:
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask.visible, enable_gqa=True)
    B, H, S, D = q.shape
    Hkv, L = keys.shape[1], keys.shape[2]
    grouped = q.reshape(B * Hkv, H // Hkv * S, D)
    scores = torch.baddbmm(mask.bias, grouped, keys.reshape(B * Hkv, L, D).transpose(1, 2), alpha=D**-0.5)
    out = torch.bmm(torch.softmax(scores, -1), values.reshape(B * Hkv, L, D))
    return out.view(B, H, S, D)
