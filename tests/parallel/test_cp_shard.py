import pytest
import torch

from codraft.parallel.cp_shard import gather, shard_batch, zigzag_layout
from codraft.parallel.mesh import ParallelDims
from tests.distributed import run_workers

LENS = [13, 1, 0, 8, 30]


def _cu(lens=LENS):
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])


def test_rank_holds_chunks_r_and_mirror():
    # one sequence of 8 at cp=2: 4 chunks of 2; rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2
    assert zigzag_layout(_cu([8]), 2, 0).position_ids.tolist() == [0, 1, 6, 7]
    assert zigzag_layout(_cu([8]), 2, 1).position_ids.tolist() == [2, 3, 4, 5]
    # a sequence of 5 is padded to 8: positions 5..7 are padding
    layout = zigzag_layout(_cu([5]), 2, 0)
    assert layout.position_ids.tolist() == [0, 1, 6, 7] and layout.is_pad.tolist() == [False, False, True, True]


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_shard_then_unshuffle_is_identity_with_padding_marked(cp):
    T = sum(LENS)
    x = torch.randn(T, 3)
    layouts = [zigzag_layout(_cu(), cp, r) for r in range(cp)]
    assert all(torch.equal(lay.cu_seqlens, layouts[0].cu_seqlens) for lay in layouts)  # same local cu everywhere
    shards = [lay.shard(x, pad_value=float("nan")) for lay in layouts]
    for lay, s in zip(layouts, shards, strict=True):
        assert s.shape[0] == lay.num_tokens
        assert torch.equal(s[lay.is_pad].isnan().all(-1), torch.ones(int(lay.is_pad.sum()), dtype=torch.bool))
        assert not s[~lay.is_pad].isnan().any()
    torch.testing.assert_close(layouts[0].unshuffle(torch.cat(shards)), x, rtol=0, atol=0)
    padded = [n + (-n) % (2 * cp) for n in LENS]
    assert sum(int((~lay.is_pad).sum()) for lay in layouts) == T
    assert sum(lay.num_tokens for lay in layouts) == sum(padded)


@pytest.mark.parametrize("cp", [2, 4])
def test_positions_are_global_within_each_sequence(cp):
    for r in range(cp):
        lay = zigzag_layout(_cu(), cp, r)
        src = lay.source[~lay.is_pad]
        seq = torch.searchsorted(_cu(), src, right=True) - 1
        assert torch.equal(lay.position_ids[~lay.is_pad], src - _cu()[seq])


@pytest.mark.parametrize("cp", [2, 4])
def test_anchors_are_routed_once_to_the_rank_holding_their_token(cp):
    anchors = torch.tensor([44, 0, 13, 14, 22, 21, 51, 30])  # unsorted, sequence starts, last token
    seen = torch.zeros(len(anchors), dtype=torch.long)
    for r in range(cp):
        lay = zigzag_layout(_cu(), cp, r)
        owned, local = lay.route(anchors)
        assert torch.equal(lay.source[local], anchors[owned])
        assert torch.equal(owned, owned.sort().values)  # kept in the caller's order
        seen[owned] += 1
    assert seen.tolist() == [1] * len(anchors)


def test_bad_inputs_are_reported_where_they_enter():
    with pytest.raises(ValueError, match="non-decreasing"):
        zigzag_layout(torch.tensor([0, 5, 3]), 2, 0)
    with pytest.raises(ValueError, match="CP rank 2"):
        zigzag_layout(_cu(), 2, 2)
    with pytest.raises(ValueError, match="T=52 rows"):
        shard_batch(torch.zeros(52, dtype=torch.long), _cu(), None, loss_mask=torch.ones(51))


def _job(rank, cp):
    torch.set_num_threads(1)
    group = ParallelDims(1, 1, cp, cp).build().cp_group
    T = sum(LENS)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, 100, (T,), generator=g)
    extra = torch.randn(T, 2, generator=g)
    batch = shard_batch(ids, _cu(), group, loss_mask=torch.ones(T), per_token={"extra": extra}, pad_id=-1)
    lay = batch.layout
    out = {"pads_ok": bool((batch.input_ids[lay.is_pad] == -1).all() and (batch.loss_mask[lay.is_pad] == 0).all())}
    x = (batch.per_token["extra"] * (rank + 1)).requires_grad_()  # differs per rank: gather must take each rank's rows
    full = gather(x, lay, group)
    w = torch.randn(T, 2, generator=torch.Generator().manual_seed(1))
    (full * w).sum().backward()
    out["gathered"] = full.detach().numpy()
    out["grad_ok"] = bool(torch.equal(x.grad, lay.shard(w)))
    errors = {}
    bad = {
        "mismatch": (ids[:-1], _cu([*LENS[:-1], 29]), extra[:-1]) if rank == 1 else (ids, _cu(), extra),
        "bad_tensor": (ids, _cu(), extra[:3] if rank == 0 else extra),
    }
    for name, (i, cu, e) in bad.items():
        try:
            shard_batch(i, cu, group, per_token={"extra": e})
        except ValueError as err:
            errors[name] = str(err)
    out["errors"] = errors
    return out


def test_shard_batch_gather_and_cross_rank_validation_cp4():
    cp = 4
    results = run_workers(_job, cp, timeout=60, pg_timeout=20)
    T = sum(LENS)
    g = torch.Generator().manual_seed(0)
    torch.randint(1, 100, (T,), generator=g)
    extra = torch.randn(T, 2, generator=g)
    for r, res in enumerate(results):
        assert res["pads_ok"] and res["grad_ok"], r
        owner = torch.zeros(T, dtype=torch.long)
        for rr in range(cp):
            lay = zigzag_layout(_cu(), cp, rr)
            owner[lay.source[~lay.is_pad]] = rr
        torch.testing.assert_close(torch.from_numpy(res["gathered"]), extra * (owner + 1)[:, None].float())
        # the same clear error on every rank, naming the culprit
        assert "different ones" in res["errors"]["mismatch"] and "rank 1: (51" in res["errors"]["mismatch"]
        assert res["errors"]["bad_tensor"].startswith("CP sharding rejected the batch on rank 0: per-token tensors")
    assert len({res["errors"]["mismatch"] for res in results}) == 1
