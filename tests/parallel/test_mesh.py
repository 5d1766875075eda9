import pytest
import torch
import torch.distributed as dist

from codraft.config import ConfigError
from codraft.parallel.mesh import ParallelDims, init_distributed
from tests.distributed import run_workers


def test_product_must_match_world_size_with_a_clear_error():
    with pytest.raises(ConfigError) as e:
        ParallelDims(dp=2, pp=1, cp=3, world_size=4)
    assert str(e.value) == (
        "parallel.dp * parallel.pp * parallel.cp must equal the world size: 2 * 1 * 3 = 6 != 4 (world size)"
    )
    with pytest.raises(ConfigError, match="'parallel.cp' must be an int >= 1"):
        ParallelDims(dp=1, pp=1, cp=0, world_size=0)


def test_rank_layout_puts_cp_innermost_then_pp_then_dp():
    dims = ParallelDims(dp=2, pp=3, cp=2, world_size=12)
    assert dims.rank_of(dp_i=1, pp_i=2, cp_i=1) == 11  # ((1 * 3) + 2) * 2 + 1
    for r in range(12):
        c = dims.coords(r)
        assert dims.rank_of(c["dp"], c["pp"], c["cp"]) == r
    assert dims.peers("cp", 5) == [4, 5]  # CP peers are neighbours
    assert dims.peers("pp", 5) == [1, 3, 5]
    assert dims.peers("dp", 5) == [5, 11]
    groups = dims.all_groups("pp")
    assert len(groups) == 4 and sorted(r for g in groups for r in g) == list(range(12))


def test_single_process_needs_no_process_group():
    dims = ParallelDims(1, 1, 1, 1).build()
    assert not dist.is_initialized()
    assert dims.cp_group is None and (dims.dp_rank, dims.pp_rank, dims.cp_rank) == (0, 0, 0)
    assert init_distributed(timeout_s=20) == (0, 1)


def _job(rank, world_size):
    torch.set_num_threads(1)
    assert init_distributed(timeout_s=20) == (rank, world_size)  # already initialised: left as it is
    dims = ParallelDims(dp=1, pp=2, cp=2, world_size=world_size).build(timeout_s=20)
    out = {"coords": (dims.dp_rank, dims.pp_rank, dims.cp_rank), "cp_ranks": dims.cp_ranks, "pp_ranks": dims.pp_ranks}
    for name, group in (("cp", dims.cp_group), ("pp", dims.pp_group), ("dp", dims.dp_group)):
        t = torch.tensor([float(rank)])
        dist.all_reduce(t, group=group)  # the sum of the group's global ranks proves its membership
        out[f"{name}_sum"] = t.item()
    ulysses, ring = dims.usp_groups(2)
    out["usp"] = (dist.get_process_group_ranks(ulysses), dist.get_process_group_ranks(ring))
    try:
        dims.usp_groups(3)
    except ConfigError as e:
        out["usp_error"] = str(e)
    return out


def test_groups_per_dimension_on_four_ranks():
    res = run_workers(_job, 4, timeout=60, pg_timeout=20)
    assert [r["coords"] for r in res] == [(0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 1, 1)]
    assert [r["cp_ranks"] for r in res] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [r["pp_ranks"] for r in res] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert [r["cp_sum"] for r in res] == [1, 1, 5, 5]
    assert [r["pp_sum"] for r in res] == [2, 4, 2, 4]
    assert [r["dp_sum"] for r in res] == [0, 1, 2, 3]
    assert [r["usp"] for r in res] == [([0, 1], [0]), ([0, 1], [1]), ([2, 3], [2]), ([2, 3], [3])]
    assert all("ulysses_degree must divide parallel.cp=2 (got 3)" in r["usp_error"] for r in res)
