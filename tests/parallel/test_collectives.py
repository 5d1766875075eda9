"""The collectives of the train step on one process (every one a no-op on dimensions of size 1), the one
gradient clip, which on one rank is torch's to the bit, and a broadcast into packed weights (two gloo ranks)."""

import copy

import torch
import torch.nn.functional as F

from codraft.drafts.vocab import HeadRows
from codraft.models.linear import Linear, pack_linears
from codraft.parallel.collectives import broadcast_in_place, clip_grad_norm_, reduce_gradients, share_rollout
from codraft.parallel.mesh import ParallelDims
from tests.distributed import run_workers


def test_clip_on_one_rank_is_torch_s_to_the_bit():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    model(torch.randn(5, 8)).square().sum().backward()
    other = copy.deepcopy(model)
    for p, q in zip(model.parameters(), other.parameters(), strict=True):
        q.grad = p.grad.clone()
    for max_norm in (0.5, 1e9):
        ours = clip_grad_norm_(model.parameters(), max_norm)
        theirs = torch.nn.utils.clip_grad_norm_(other.parameters(), max_norm)
        assert ours == float(theirs)
        for p, q in zip(model.parameters(), other.parameters(), strict=True):
            assert torch.equal(p.grad, q.grad)


def test_max_norm_zero_turns_the_clip_off_and_a_tied_copy_can_be_left_out_of_the_norm():
    w = torch.nn.Parameter(torch.ones(4))
    w.grad = torch.full((4,), 3.0)
    tied = torch.nn.Parameter(torch.ones(4))
    tied.grad = w.grad.clone()
    assert clip_grad_norm_([w, tied], 0.0, counted=[w]) == 6.0  # |(3, 3, 3, 3)|, the copy not counted
    assert torch.equal(w.grad, torch.full((4,), 3.0))  # not scaled


def test_one_process_generates_its_rollout_and_reduces_nothing():
    dims = ParallelDims.single()
    assert share_rollout(lambda: "rollout", dims) == "rollout"
    p = torch.nn.Linear(2, 2)
    p(torch.ones(1, 2)).sum().backward()
    before = p.weight.grad.clone()
    reduce_gradients([p], dims)
    assert torch.equal(p.weight.grad, before)


def _broadcast_into_packed(rank: int, world_size: int) -> list[float]:
    torch.manual_seed(rank)  # the ranks start apart
    linear = Linear(8, 6, bias=False)
    rows, ids = HeadRows(), torch.tensor([1, 4, 5])
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        pack_linears(linear)
        rows(linear.weight, ids)(x)  # a packed copy of each, keyed on the weight as it was
        broadcast_in_place(linear.weight, src=0)
        torch.testing.assert_close(linear(x), F.linear(x, linear.weight))  # the copies see the new weight
        torch.testing.assert_close(rows(linear.weight, ids)(x), F.linear(x, linear.weight[ids]))
    return linear.weight.flatten().tolist()


def test_a_broadcast_in_place_makes_packed_copies_of_the_weight_stale():
    weights = run_workers(_broadcast_into_packed, 2, timeout=60.0)
    assert weights[0] == weights[1]
