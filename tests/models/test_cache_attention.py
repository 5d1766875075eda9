"""Attention over a KV cache: the grouped matmuls give SDPA's output for every shape a step can bring."""

import pytest
import torch
import torch.nn.functional as F

from codraft.models.cache_attention import MAX_GROUPED_QUERIES, CacheMask, cache_attention


def visible_mask(B: int, S: int, L: int, broadcast: bool) -> torch.Tensor:
    """Random visibility where every query sees its own column (as a cache's queries do)."""
    g = torch.Generator().manual_seed(B * 100 + S)
    rows = 1 if broadcast else S
    visible = torch.rand(B, rows, L, generator=g) < 0.6
    visible[..., -1] = True
    return visible


@pytest.mark.parametrize("B,S", [(1, 1), (1, 5), (3, 2), (8, 1), (4, 8), (2, MAX_GROUPED_QUERIES)])
@pytest.mark.parametrize("heads", [(4, 2), (6, 6), (9, 3)])
@pytest.mark.parametrize("broadcast", [False, True])
def test_grouped_attention_matches_sdpa(B, S, heads, broadcast):
    H, Hkv = heads
    torch.manual_seed(0)
    cache_k, cache_v = torch.randn(2, B, Hkv, 40, 16).unbind(0)
    L = 23
    keys, values = cache_k[:, :, :L], cache_v[:, :, :L]  # strided views of the cache's columns, as in a forward
    q = torch.randn(B, S, H, 16).transpose(1, 2)  # [B, H, S, D] view, as the model makes it
    visible = visible_mask(B, S, L, broadcast)
    mask = CacheMask(visible, S, H, Hkv, q.dtype)
    assert mask.grouped
    out = cache_attention(q, keys, values, mask)
    expected = F.scaled_dot_product_attention(q, keys, values, attn_mask=visible[:, None], enable_gqa=True)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_long_query_blocks_and_half_precision_stay_on_sdpa():
    """Prefill: the grouped bias would be [B * Hkv, G * S, L], and SDPA measured faster there. bf16/fp16: the
    grouped matmuls would softmax scores rounded to that dtype, where SDPA accumulates in fp32."""
    visible = torch.ones(2, MAX_GROUPED_QUERIES + 1, 30, dtype=torch.bool)
    mask = CacheMask(visible, MAX_GROUPED_QUERIES + 1, 4, 2, torch.float32)
    assert not mask.grouped and mask.bias is None
    for dtype in (torch.bfloat16, torch.float16):
        assert not CacheMask(visible[:, :2], 2, 4, 2, dtype).grouped
