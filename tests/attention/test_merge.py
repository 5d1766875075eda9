import torch

from codraft.attention import merge_attention

NEG_INF = float("-inf")


def _attend(q, k, v):
    """q [L, D], k/v [S, D] -> out [L, D], lse [L] in fp64 (S may be 0: out 0, lse -inf)."""
    s = q @ k.T / q.shape[-1] ** 0.5
    lse = torch.logsumexp(s, -1) if k.shape[0] else torch.full(q.shape[:1], NEG_INF, dtype=q.dtype)
    p = torch.exp(s - lse.nan_to_num(neginf=0.0)[:, None])
    return p @ v, lse


def test_merge_of_two_key_halves_equals_attending_the_whole_set():
    torch.manual_seed(0)
    q, k, v = (torch.randn(n, 8, dtype=torch.float64) for n in (6, 11, 11))
    out, lse = _attend(q, k, v)
    o1, l1 = _attend(q, k[:4], v[:4])
    o2, l2 = _attend(q, k[4:], v[4:])
    mo, ml = merge_attention(o1, l1, o2, l2)
    torch.testing.assert_close(mo, out, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(ml, lse, rtol=1e-12, atol=1e-12)
    # the ring's running update: merging block by block in any order gives the same result
    acc_o, acc_l = torch.zeros_like(out), torch.full_like(lse, NEG_INF)
    for idx in (slice(7, 11), slice(0, 3), slice(3, 7)):
        acc_o, acc_l = merge_attention(acc_o, acc_l, *_attend(q, k[idx], v[idx]))
    torch.testing.assert_close(acc_o, out, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(acc_l, lse, rtol=1e-12, atol=1e-12)


def test_merge_keeps_rows_with_no_key_at_zero_and_neg_inf():
    o1, o2 = torch.randn(3, 4), torch.randn(3, 4)
    l1 = torch.tensor([NEG_INF, NEG_INF, 0.5])
    l2 = torch.tensor([NEG_INF, 1.5, NEG_INF])
    out, lse = merge_attention(o1, l1, o2, l2)
    assert not out.isnan().any() and not lse.isnan().any()
    assert torch.equal(out[0], torch.zeros(4)) and lse[0] == NEG_INF
    torch.testing.assert_close(out[1], o2[1])  # one side empty: the other side unchanged
    torch.testing.assert_close(out[2], o1[2])
    torch.testing.assert_close(lse[1:], torch.tensor([1.5, 0.5]))


def test_merge_computes_in_fp32_from_low_precision_inputs():
    o = torch.randn(2, 4, dtype=torch.bfloat16)
    lse = torch.zeros(2)
    out, lse_out = merge_attention(o, lse, o, lse)
    assert out.dtype == torch.float32 and lse_out.dtype == torch.float32
    torch.testing.assert_close(out, o.float())
    torch.testing.assert_close(lse_out, torch.full((2,), float(torch.tensor(2.0).log())))
