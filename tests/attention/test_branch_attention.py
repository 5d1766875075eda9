import math

import pytest
import torch

from codraft.attention import Branches, branch_attention, causal_attention

NEG_INF = float("-inf")
LENS = [5, 9, 0, 3]  # packed sequences of different lengths, one of them empty
H, HKV, D = 4, 2, 8


def _packed(lens=LENS, h=H, hkv=HKV, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    T = sum(lens)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    q, k, v = (torch.randn(T, n, D, generator=g, dtype=dtype) for n in (h, hkv, hkv))
    return q, k, v, cu


def _branches(anchors, Qg, Kg, inclusive, mask=None, h=H, hkv=HKV, dtype=torch.float64, seed=1):
    g = torch.Generator().manual_seed(seed)
    G = len(anchors)
    bq = torch.randn(G, Qg, h, D, generator=g, dtype=dtype)
    bk, bv = (torch.randn(G, Kg, hkv, D, generator=g, dtype=dtype) for _ in range(2))
    return Branches(bq, bk, bv, torch.tensor(anchors, dtype=torch.long), inclusive, mask)


def _ttt(T, k, inclusive, **kw):
    """EAGLE-3 TTT step k: one query per main position, anchored there, k branch-local keys."""
    return _branches(list(range(T)), 1, k, inclusive, **kw)


def _dflash(anchors, mask=None, **kw):
    """DFlash/DSpark: blocks of 8 queries with 8 block keys, exclusive anchors."""
    return _branches(anchors, 8, 8, False, mask, **kw)


def _mask(Qg, Kg, seed=2):
    m = torch.rand(Qg, Kg, generator=torch.Generator().manual_seed(seed)) > 0.5
    m[:, 0] = True
    m[1] = False  # one query sees no branch-local key
    return m


def _run(impl, q, k, v, cu, b, dtype=None):
    """Forward + backward of a fixed random linear loss on out and branch_out; returns outputs and grads."""
    dtype = dtype or q.dtype
    leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v, b.q, b.k, b.v)]
    bb = Branches(*leaves[3:], b.anchors, b.inclusive, b.mask)
    res = branch_attention(*leaves[:3], cu, bb, impl=impl)
    g = torch.Generator().manual_seed(3)
    w_out = torch.randn(res.out.shape, generator=g, dtype=torch.float64).to(dtype)
    w_bout = torch.randn(res.branch_out.shape, generator=g, dtype=torch.float64).to(dtype)
    ((res.out * w_out).sum() + (res.branch_out * w_bout).sum()).backward()
    return [res.out, res.lse, res.branch_out, res.branch_lse] + [t.grad for t in leaves]


NAMES = ["out", "lse", "branch_out", "branch_lse", "dq", "dk", "dv", "dbq", "dbk", "dbv"]


def _assert_match(got, want, rtol, atol):
    for name, a, b in zip(NAMES, got, want, strict=True):
        assert not a.isnan().any(), name
        torch.testing.assert_close(a.to(b.dtype), b, rtol=rtol, atol=atol, msg=lambda m, n=name: f"{n}: {m}")


# The branch shapes of every draft family on the packed batch LENS (T = 17, sequence starts 0, 5, 14).
CASES = {
    "ttt_inclusive_k1": lambda T: _ttt(T, 1, True),
    "ttt_inclusive_k3": lambda T: _ttt(T, 3, True),
    "ttt_exclusive_k2": lambda T: _ttt(T, 2, False),
    "dflash_exclusive_at_sequence_starts": lambda T: _dflash([0, 3, 5, 9, 14, 16]),
    "dflash_masked": lambda T: _dflash([2, 5, 7, 15], mask=_mask(8, 8)),
    "groups_inclusive_masked": lambda T: _branches([0, 4, 6, 13, 14], 3, 5, True, _mask(3, 5)),
    "one_group_per_sequence": lambda T: _branches([4, 10, 16], 2, 3, False),
}


@pytest.mark.parametrize("case", list(CASES))
def test_fused_matches_dense_fp64(case):
    q, k, v, cu = _packed()
    b = CASES[case](q.shape[0])
    _assert_match(_run("fused", q, k, v, cu, b), _run("dense", q, k, v, cu, b), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("case", ["ttt_inclusive_k3", "dflash_masked"])
def test_fused_fp32_matches_dense_fp64(case):
    q, k, v, cu = _packed()
    b = CASES[case](q.shape[0])
    got = _run("fused", q, k, v, cu, b, dtype=torch.float32)
    assert got[1].dtype == torch.float32 and got[3].dtype == torch.float32  # LSE in fp32
    _assert_match(got, _run("dense", q, k, v, cu, b), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("hkv", [1, 4])  # MQA (stride-0 expansion) and plain multi-head
def test_fused_matches_dense_other_head_groupings(hkv):
    q, k, v, cu = _packed(hkv=hkv)
    b = _branches([1, 5, 8, 14], 4, 3, False, _mask(4, 3), hkv=hkv)
    _assert_match(_run("fused", q, k, v, cu, b), _run("dense", q, k, v, cu, b), rtol=1e-10, atol=1e-10)


def test_fused_bf16_is_close_to_dense():
    q, k, v, cu = _packed()
    b = _dflash([2, 5, 7, 15], mask=_mask(8, 8))
    got = _run("fused", q, k, v, cu, b, dtype=torch.bfloat16)
    want = _run("dense", q, k, v, cu, b)
    assert got[1].dtype == torch.float32
    for name, a, w in zip(NAMES, got, want, strict=True):
        assert not a.isnan().any(), name
        torch.testing.assert_close(a.double(), w, rtol=0.05, atol=0.05, msg=lambda m, n=name: f"{n}: {m}")


def test_causal_attention_matches_dense_and_sdpa():
    q, k, v, cu = _packed()
    out, lse = causal_attention(q, k, v, cu)
    ref_out, ref_lse = causal_attention(q, k, v, cu, impl="dense")
    torch.testing.assert_close(out, ref_out, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-12, atol=1e-12)
    s0, s1 = 5, 14  # the 9-token sequence on its own, through torch's SDPA
    sdpa = torch.nn.functional.scaled_dot_product_attention(
        q[s0:s1].transpose(0, 1), k[s0:s1].transpose(0, 1), v[s0:s1].transpose(0, 1), is_causal=True, enable_gqa=True
    )
    torch.testing.assert_close(out[s0:s1], sdpa.transpose(0, 1), rtol=1e-12, atol=1e-12)


def _brute_force(q, k, v, cu, b, scale):
    """Per query, per head: list the visible keys by the contract's words, softmax them."""
    T, h = q.shape[:2]
    G, Qg = b.q.shape[:2]
    group = h // k.shape[1]
    starts = cu.tolist()

    def seq_start(t):
        return max(s for s in starts[:-1] if s <= t)

    def attend(qv, keys, vals):
        if not keys:
            return torch.zeros_like(qv), NEG_INF
        s = torch.stack([qv @ kk for kk in keys]) * scale
        lse = torch.logsumexp(s, 0)
        return sum(torch.exp(si - lse) * vv for si, vv in zip(s, vals, strict=True)), lse.item()

    out, lse = torch.zeros_like(q), torch.zeros(q.shape[:2], dtype=q.dtype)
    bout, blse = torch.zeros_like(b.q), torch.zeros(b.q.shape[:3], dtype=q.dtype)
    for hh in range(h):
        kh = hh // group
        for t in range(T):
            js = range(seq_start(t), t + 1)
            out[t, hh], lse[t, hh] = attend(q[t, hh], [k[j, kh] for j in js], [v[j, kh] for j in js])
        for g in range(G):
            a = int(b.anchors[g])
            js = list(range(seq_start(a), a + 1 if b.inclusive else a))
            for i in range(Qg):
                ls = [j for j in range(b.k.shape[1]) if b.mask is None or b.mask[i, j]]
                keys = [k[j, kh] for j in js] + [b.k[g, j, kh] for j in ls]
                vals = [v[j, kh] for j in js] + [b.v[g, j, kh] for j in ls]
                bout[g, i, hh], blse[g, i, hh] = attend(b.q[g, i, hh], keys, vals)
    return out, lse, bout, blse


@pytest.mark.parametrize("inclusive", [True, False])
def test_dense_reference_matches_brute_force_loop(inclusive):
    q, k, v, cu = _packed(lens=[4, 6, 3])
    b = _branches([0, 2, 4, 9, 12], 3, 4, inclusive, _mask(3, 4))
    scale = 0.3
    res = branch_attention(q, k, v, cu, b, impl="dense", scale=scale)
    want = _brute_force(q, k, v, cu, b, scale)
    for a, w in zip((res.out, res.lse, res.branch_out, res.branch_lse), want, strict=True):
        torch.testing.assert_close(a, w, rtol=1e-12, atol=1e-12)
    fused = branch_attention(q, k, v, cu, b, impl="fused", scale=scale)
    torch.testing.assert_close(fused.branch_out, want[2], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("impl", ["dense", "fused"])
def test_rows_that_see_no_key_are_zero_with_neg_inf_lse_and_zero_grads(impl):
    q, k, v, cu = _packed()
    mask = torch.ones(8, 8, dtype=torch.bool)
    mask[2] = False  # query 2 of every group sees no branch-local key
    b = _dflash([0, 5, 9], mask=mask)  # groups 0 and 1 are anchored at sequence starts: empty main prefix
    leaves = [t.clone().requires_grad_() for t in (q, k, v, b.q, b.k, b.v)]
    res = branch_attention(*leaves[:3], cu, Branches(*leaves[3:], b.anchors, False, mask), impl=impl)
    assert torch.equal(res.branch_out[:2, 2], torch.zeros(2, H, D))
    assert (res.branch_lse[:2, 2] == NEG_INF).all()
    assert torch.isfinite(res.branch_lse[2]).all() and torch.isfinite(res.branch_lse[:2, [0, 1, 3]]).all()
    (res.out.sum() + res.branch_out.sum()).backward()
    for t in leaves:
        assert torch.isfinite(t.grad).all()
    assert torch.equal(leaves[3].grad[:2, 2], torch.zeros(2, H, D))


@pytest.mark.parametrize("impl", ["dense", "fused"])
def test_branch_queries_only_when_q_is_none(impl):
    q, k, v, cu = _packed()
    b = _ttt(q.shape[0], 2, True)
    full = branch_attention(q, k, v, cu, b, impl=impl)
    only = branch_attention(None, k, v, cu, b, impl=impl)
    assert only.out is None and only.lse is None
    # equal up to fp64 rounding: BLAS may block a GEMM of fewer query rows differently
    torch.testing.assert_close(only.branch_out, full.branch_out, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(only.branch_lse, full.branch_lse, rtol=1e-12, atol=1e-14)


def test_default_scale_is_inverse_sqrt_head_dim():
    q, k, v, cu = _packed()
    b = _dflash([2, 7])
    a = branch_attention(q, k, v, cu, b)
    c = branch_attention(q, k, v, cu, b, scale=1 / math.sqrt(D))
    torch.testing.assert_close(a.branch_out, c.branch_out, rtol=1e-14, atol=1e-14)


def test_fused_refuses_to_backpropagate_through_lse():
    q, k, v, cu = _packed()
    q.requires_grad_()
    _, lse = causal_attention(q, k, v, cu)
    with pytest.raises(NotImplementedError, match="LSE"):
        lse.sum().backward()


def test_fused_raises_clearly_off_cpu():
    q, k, v = (t.to("meta") for t in _packed()[:3])
    with pytest.raises(NotImplementedError, match="impl='dense'"):
        causal_attention(q, k, v, torch.tensor([0, 17]))


def test_bad_shapes_are_reported():
    q, k, v, cu = _packed()
    with pytest.raises(ValueError, match="cu_seqlens"):
        causal_attention(q, k, v, cu[:-1])
    b = _dflash([2, 7])
    b.anchors = torch.tensor([2, 99])
    with pytest.raises(ValueError, match="anchors"):
        branch_attention(q, k, v, cu, b)


def test_fused_matches_dense_on_strided_inputs():
    # views whose head dim is not unit-stride (the CPU kernel silently misreads those unless copied)
    q, k, v, cu = _packed()
    b = _dflash([2, 5, 7, 15], mask=_mask(8, 8))

    def strided(t):
        return t.transpose(-1, -2).contiguous().transpose(-1, -2)

    sb = Branches(strided(b.q), strided(b.k), strided(b.v), b.anchors, False, b.mask)
    got = _run("fused", strided(q), strided(k), strided(v), cu, sb)
    _assert_match(got, _run("dense", q, k, v, cu, b), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("b", [_branches([], 8, 8, False), _branches([3, 9], 2, 0, True)], ids=["G0", "Kg0"])
def test_fused_matches_dense_without_groups_or_local_keys(b):
    q, k, v, cu = _packed()
    _assert_match(_run("fused", q, k, v, cu, b), _run("dense", q, k, v, cu, b), rtol=1e-10, atol=1e-10)
