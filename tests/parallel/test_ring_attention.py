"""Zigzag ring and USP branch attention vs the single-device dense reference, forward and backward.

Each CP degree is one multi-process job (process start-up dominates on CPU) that runs every case on its
shard and returns the local results; the parent reassembles them with the same layout and compares.
"""

import time

import pytest
import torch
import torch.distributed as dist

from codraft.attention import Branches, branch_attention
from codraft.parallel.cp_shard import zigzag_layout
from codraft.parallel.mesh import ParallelDims
from codraft.parallel.ring_attention import apply_cp, ring_branch_attention
from codraft.parallel.usp_attention import usp_branch_attention
from tests.distributed import run_workers

# Packed lengths: not multiples of 2cp (padding), one empty, one so short that some cp=4 ranks hold only padding.
LENS = [13, 29, 0, 3, 40]
D = 8
NAMES = ["out", "lse", "branch_out", "branch_lse", "dq", "dk", "dv", "dbq", "dbk", "dbv"]


def _cu(lens=LENS):
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])


def _dflash_anchors(lens=LENS):
    """Every sequence start, then every 3rd token: anchors in both zigzag halves of every rank."""
    cu = _cu(lens).tolist()
    starts = [s for s, e in zip(cu[:-1], cu[1:], strict=True) if e > s]
    return sorted(set(starts) | set(range(1, cu[-1], 3)))


# name -> (H, Hkv, main queries?, branch spec (kind, Qg, Kg, inclusive, masked) or None, dtype)
CASES = {
    "policy_causal": (4, 2, True, None, torch.float64),
    "ttt_step1_inclusive": (4, 2, False, ("ttt", 1, 1, True, False), torch.float64),
    "ttt_step3_inclusive": (4, 2, False, ("ttt", 1, 3, True, False), torch.float64),
    "ttt_with_main_exclusive": (4, 2, True, ("ttt", 1, 2, False, False), torch.float64),
    "dflash_exclusive": (4, 2, False, ("groups", 4, 4, False, False), torch.float64),
    "dflash_masked_with_main": (4, 2, True, ("groups", 4, 4, False, True), torch.float64),
    "groups_inclusive_masked_mqa": (4, 1, True, ("groups", 3, 2, True, True), torch.float64),
    "dflash_mha": (4, 4, True, ("groups", 4, 4, False, False), torch.float64),
    "ttt_fp32": (4, 2, True, ("ttt", 1, 2, True, False), torch.float32),
}


def _mask(Qg, Kg):
    m = torch.rand(Qg, Kg, generator=torch.Generator().manual_seed(2)) > 0.5
    m[:, 0] = True
    m[1] = False  # one query sees no branch-local key
    return m


def _inputs(case):
    """Global tensors of a case (identical in every process): q, k, v, branches (global anchors), loss weights."""
    H, Hkv, main, spec, dtype = CASES[case]
    g = torch.Generator().manual_seed(0)
    T = sum(LENS)
    q, k, v = (torch.randn(T, n, D, generator=g, dtype=torch.float64).to(dtype) for n in (H, Hkv, Hkv))
    branches = None
    if spec is not None:
        kind, Qg, Kg, inclusive, masked = spec
        anchors = torch.arange(T) if kind == "ttt" else torch.tensor(_dflash_anchors())
        G = len(anchors)
        bq = torch.randn(G, Qg, H, D, generator=g, dtype=torch.float64).to(dtype)
        bk, bv = (torch.randn(G, Kg, Hkv, D, generator=g, dtype=torch.float64).to(dtype) for _ in range(2))
        branches = Branches(bq, bk, bv, anchors, inclusive, _mask(Qg, Kg) if masked else None)
    w_out = torch.randn(T, H, D, generator=g, dtype=torch.float64).to(dtype)
    w_bout = None if branches is None else torch.randn(branches.q.shape, generator=g, dtype=torch.float64).to(dtype)
    return (q if main else None), k, v, branches, w_out, w_bout


def _loss_backward(res, leaves, w_out, w_bout):
    loss = 0
    if res.out is not None:
        loss = loss + (res.out * w_out).sum()
    if res.branch_out is not None:
        loss = loss + (res.branch_out * w_bout).sum()
    loss.backward()
    return [res.out, res.lse, res.branch_out, res.branch_lse] + [None if t is None else t.grad for t in leaves]


def _reference(case):
    q, k, v, b, w_out, w_bout = _inputs(case)
    leaves = [None if t is None else t.double().requires_grad_() for t in (q, k, v)]
    bb = None
    if b is not None:
        leaves += [t.double().requires_grad_() for t in (b.q, b.k, b.v)]
        bb = Branches(*leaves[3:], b.anchors, b.inclusive, b.mask)
    res = branch_attention(*leaves[:3], _cu(), bb, impl="dense")
    wb = None if w_bout is None else w_bout.double()
    return _loss_backward(res, leaves + [None] * (6 - len(leaves)), w_out.double(), wb)


def _run_local(case, rank, cp, attention):
    """One rank's shard of a case through `attention(q, k, v, cu, branches)`; local results as numpy."""
    q, k, v, b, w_out, w_bout = _inputs(case)
    layout = zigzag_layout(_cu(), cp, rank)
    leaves = [None if t is None else layout.shard(t).requires_grad_() for t in (q, k, v)]
    bb = owned = None
    if b is not None:
        if b.q.shape[1] == 1 and len(b.anchors) == sum(LENS):  # TTT: one branch per token, sharded like tokens
            bt = [layout.shard(t).requires_grad_() for t in (b.q, b.k, b.v)]
            anchors = torch.arange(layout.num_tokens)
            w_bout = layout.shard(w_bout)
        else:  # DFlash-like groups: routed to the owner of their anchor
            owned, anchors = layout.route(b.anchors)
            bt = [t[owned].requires_grad_() for t in (b.q, b.k, b.v)]
            w_bout = w_bout[owned]
        leaves += bt
        bb = Branches(*bt, anchors, b.inclusive, b.mask)
    res = attention(*leaves[:3], layout.cu_seqlens, bb)
    got = _loss_backward(res, leaves + [None] * (6 - len(leaves)), layout.shard(w_out), w_bout)
    return [None if t is None else t.detach().numpy() for t in got], None if owned is None else owned.numpy()


def _assemble(case, cp, per_rank):
    """Local results of every rank -> global tensors in the reference's layout."""
    layout = zigzag_layout(_cu(), cp, 0)
    _, _, _, b, _, _ = _inputs(case)
    per_token = {"out", "lse", "dq", "dk", "dv"}
    ttt = b is not None and per_rank[0][1] is None
    out = []
    for i, name in enumerate(NAMES):
        parts = [torch.from_numpy(r[0][i]) if r[0][i] is not None else None for r in per_rank]
        if parts[0] is None:
            out.append(None)
        elif name in per_token or ttt:
            out.append(layout.unshuffle(torch.cat(parts)))
        else:
            full = torch.zeros(len(b.anchors), *parts[0].shape[1:], dtype=parts[0].dtype)
            for (_, owned), p in zip(per_rank, parts, strict=True):
                full[torch.from_numpy(owned)] = p
            out.append(full)
    return out


def _assert_match(got, want, case, label=""):
    tol = 1e-9 if CASES[case][4] == torch.float64 else 2e-5
    for name, a, w in zip(NAMES, got, want, strict=True):
        assert (a is None) == (w is None), name
        if a is not None:
            assert not a.isnan().any(), f"{case} {name}"
            msg = f"{case}{label} {name}"
            torch.testing.assert_close(a.double(), w, rtol=tol, atol=tol, msg=lambda m, msg=msg: f"{msg}: {m}")


# --- the multi-process jobs: one per CP degree -------------------------------------------------------------

USP = {
    2: [(2, ["policy_causal", "ttt_step3_inclusive", "dflash_masked_with_main"])],
    4: [(2, ["policy_causal", "ttt_with_main_exclusive", "dflash_masked_with_main"]), (4, ["dflash_mha"])],
}


def _tiny_model():
    from codraft.models.args import ModelArgs
    from codraft.models.model import Transformer

    torch.manual_seed(0)
    args = ModelArgs(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2)
    return Transformer(args).double()


def _job(rank, cp):
    torch.set_num_threads(1)  # run_workers' OMP_NUM_THREADS comes after torch's pool exists; oversubscription
    dims = ParallelDims(1, 1, cp, cp).build()
    group = dims.cp_group
    results = {"ring": {}, "usp": {}}
    for case in CASES:
        results["ring"][case] = _run_local(case, rank, cp, lambda *a: ring_branch_attention(*a, group))
    for u, cases in USP[cp]:
        ulysses, ring = dims.usp_groups(u)
        for case in cases:
            results["usp"][(u, case)] = _run_local(
                case, rank, cp, lambda *a, ul=ulysses, rg=ring: usp_branch_attention(*a, ul, rg)
            )
    ulysses, ring = dims.usp_groups(cp)  # H=4, Hkv=2 cannot split 4 ways: refused before any communication
    try:
        _run_local("policy_causal", rank, cp, lambda *a: usp_branch_attention(*a, ulysses, ring))
        results["usp_error"] = None
    except ValueError as e:
        results["usp_error"] = str(e)
    # the policy with every attention layer swapped to the ring, fed its zigzag shard
    model = apply_cp(_tiny_model(), dims)
    layout = zigzag_layout(_cu(), cp, rank)
    ids = torch.randint(0, 64, (sum(LENS),), generator=torch.Generator().manual_seed(5))
    logits = model(layout.shard(ids)[None], positions=layout.position_ids[None], cu_seqlens=layout.cu_seqlens).logits
    results["model_logits"] = logits[0].detach().numpy()
    return results


@pytest.fixture(scope="module", params=[2, 4], ids=["cp2", "cp4"])
def job(request):
    cp = request.param
    return cp, run_workers(_job, cp, timeout=150, pg_timeout=60)


@pytest.mark.parametrize("case", list(CASES))
def test_ring_branch_attention_matches_dense(job, case):
    cp, results = job
    got = _assemble(case, cp, [r["ring"][case] for r in results])
    _assert_match(got, _reference(case), case)


def test_usp_matches_dense_where_heads_divide(job):
    cp, results = job
    for u, cases in USP[cp]:
        for case in cases:
            got = _assemble(case, cp, [r["usp"][(u, case)] for r in results])
            _assert_match(got, _reference(case), case, f" (ulysses {u})")


def test_usp_refuses_head_counts_that_do_not_divide(job):
    cp, results = job
    if cp == 2:  # H=4, Hkv=2 divide by 2: no error expected
        assert all(r["usp_error"] is None for r in results)
        return
    for r in results:
        assert "query heads 4, KV heads 2, ulysses_degree 4" in r["usp_error"]


def test_apply_cp_policy_matches_single_device(job):
    cp, results = job
    layout = zigzag_layout(_cu(), cp, 0)
    got = layout.unshuffle(torch.cat([torch.from_numpy(r["model_logits"]) for r in results]))
    ids = torch.randint(0, 64, (sum(LENS),), generator=torch.Generator().manual_seed(5))
    want = _tiny_model()(ids[None], cu_seqlens=_cu()).logits[0]
    torch.testing.assert_close(got, want.detach(), rtol=1e-9, atol=1e-9)


def test_cases_cover_both_zigzag_halves_and_sequence_starts():
    for cp in (2, 4):
        for rank in range(cp):
            layout = zigzag_layout(_cu(), cp, rank)
            _, local = layout.route(torch.tensor(_dflash_anchors()))
            seq = torch.searchsorted(layout.cu_seqlens.long(), local, right=True) - 1
            offset = local - layout.cu_seqlens.long()[seq]
            first_half = offset < layout.cu_seqlens.diff().long()[seq] // 2
            assert first_half.any() and (~first_half).any(), (cp, rank)
            if rank == 0:  # chunk 0 holds every sequence start
                assert int((layout.position_ids[local] == 0).sum()) == sum(n > 0 for n in LENS)


@pytest.mark.parametrize("case", ["ttt_with_main_exclusive", "dflash_masked_with_main"])
def test_ring_of_one_rank_is_the_single_device_op(case):
    got = _assemble(case, 1, [_run_local(case, 0, 1, lambda *a: ring_branch_attention(*a, None))])
    _assert_match(got, _reference(case), case)


def test_ring_refuses_inputs_that_are_not_a_zigzag_shard():
    q = torch.randn(7, 2, D)
    with pytest.raises(ValueError, match=r"two zigzag chunks per sequence \(even lengths\); got lengths \[4, 3\]"):
        ring_branch_attention(q, q, q, torch.tensor([0, 4, 7]), None, None)


def _rank1_raises(rank, cp):
    torch.set_num_threads(1)
    group = ParallelDims(1, 1, cp, cp).build().cp_group
    if rank == 1:
        raise ValueError("rank 1 gave up before the ring")
    q = torch.randn(8, 2, D)
    ring_branch_attention(q, q[:, :1], q[:, :1], torch.tensor([0, 8]), None, group)


def test_a_rank_that_raises_fails_the_job_without_a_hang():
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="rank 1 gave up"):
        run_workers(_rank1_raises, 2, timeout=60, pg_timeout=5)
    assert time.monotonic() - t0 < 45
    assert not dist.is_initialized()
