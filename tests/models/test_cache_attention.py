"""Attention over a KV cache: codraft's kernel and the grouped matmuls give SDPA's output for every shape a step can
bring, and the kernel gives a query the same bits in a decode step as in a verify forward, alone or in a batch."""

import pytest
import torch
import torch.nn.functional as F

from codraft.models import cpu_kernels
from codraft.models.cache_attention import MAX_GROUPED_QUERIES, CacheMask, cache_attention


@pytest.fixture(params=["kernel", "grouped"])
def path(request, monkeypatch):
    """Which of the two runs a step's attention: codraft's kernel where it loads, else the grouped matmuls."""
    if request.param == "kernel" and cpu_kernels.cpu_kernels() is None:
        pytest.skip("codraft's kernels do not run here (no AVX-512, OpenMP or C++ compiler)")
    if request.param == "grouped":
        monkeypatch.setattr(cpu_kernels, "cpu_kernels", lambda: None)
    return request.param


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
@pytest.mark.parametrize("D", [16, 24, 64])  # 24: a partial last chunk of 16 lanes
def test_attention_over_a_cache_matches_sdpa(B, S, heads, broadcast, D, path):
    H, Hkv = heads
    torch.manual_seed(0)
    cache_k, cache_v = torch.randn(2, B, Hkv, 40, D).unbind(0)
    L = 23
    keys, values = cache_k[:, :, :L], cache_v[:, :, :L]  # strided views of the cache's columns, as in a forward
    q = torch.randn(B, S, H, D).transpose(1, 2)  # [B, H, S, D] view, as the model makes it
    visible = visible_mask(B, S, L, broadcast)
    mask = CacheMask(visible, S, H, Hkv, D, q.dtype)
    assert (mask.kernel, mask.grouped) == (path == "kernel", path == "grouped")
    out = cache_attention(q, keys, values, mask)
    expected = F.scaled_dot_product_attention(q, keys, values, attn_mask=visible[:, None], enable_gqa=True)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_the_kernel_gives_a_query_the_same_bits_in_a_decode_step_a_verify_forward_and_alone():
    """Greedy speculation must compute what plain decoding does: a verify forward's query s sees the cache's first
    L0 + s + 1 columns, as the decode step of that token does with a cache of that length; what lies past the
    columns a query sees (a cache's stale or unwritten slots, here NaN) is never read."""
    if cpu_kernels.cpu_kernels() is None:
        pytest.skip("codraft's kernels do not run here (no AVX-512, OpenMP or C++ compiler)")
    torch.manual_seed(0)
    B, H, Hkv, D, L0, S = 5, 9, 3, 64, 150, 8
    cache_k, cache_v = torch.randn(2, B, Hkv, L0 + S + 10, D).unbind(0)
    cache_k[:, :, L0 + S:], cache_v[:, :, L0 + S:] = float("nan"), float("nan")
    q = torch.randn(B, S, H, D).transpose(1, 2)
    L = L0 + S
    visible = torch.arange(L) <= (L0 + torch.arange(S))[:, None]  # [S, L], causal over the new tokens
    mask = CacheMask(visible.expand(B, S, L), S, H, Hkv, D, q.dtype)
    assert mask.kernel  # (the grouped matmuls' sums depend on the call's shape, ~1e-7)
    verify = cache_attention(q, cache_k[:, :, :L], cache_v[:, :, :L], mask)
    assert not verify.isnan().any()
    for s in range(S):
        seen = L0 + s + 1
        decode = cache_attention(q[:, :, s : s + 1], cache_k[:, :, :seen], cache_v[:, :, :seen],
                                 CacheMask(torch.ones(B, 1, seen, dtype=torch.bool), 1, H, Hkv, D, q.dtype))
        assert torch.equal(decode[:, :, 0], verify[:, :, s]), s
    for b in range(B):
        alone = cache_attention(q[b : b + 1], cache_k[b : b + 1, :, :L], cache_v[b : b + 1, :, :L],
                                CacheMask(visible.expand(1, S, L), S, H, Hkv, D, q.dtype))
        assert torch.equal(alone[0], verify[b]), b


def test_long_query_blocks_wide_heads_and_half_precision_stay_on_sdpa_or_the_matmuls():
    """Prefill: the grouped bias would be [B * Hkv, G * S, L], and SDPA measured faster there; so was it than the
    kernel's one query at a time. bf16/fp16: the grouped matmuls would softmax scores rounded to that dtype, where
    SDPA accumulates in fp32. The kernel takes head dims up to 256."""
    visible = torch.ones(2, MAX_GROUPED_QUERIES + 1, 30, dtype=torch.bool)
    mask = CacheMask(visible, MAX_GROUPED_QUERIES + 1, 4, 2, 64, torch.float32)
    assert not mask.grouped and not mask.kernel and mask.bias is None
    for dtype in (torch.bfloat16, torch.float16):
        half = CacheMask(visible[:, :2], 2, 4, 2, 64, dtype)
        assert not half.grouped and not half.kernel
    assert not CacheMask(visible[:, :2], 2, 4, 2, cpu_kernels.MAX_HEAD_DIM + 16, torch.float32).kernel
