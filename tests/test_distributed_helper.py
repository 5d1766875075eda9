import pytest
import torch
import torch.distributed as dist

from tests.distributed import run_workers


def _all_reduce(rank, world_size):
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    return t.item()


def _fails_on_rank_1(rank, world_size):
    if rank == 1:
        raise ValueError("boom on rank 1")
    dist.barrier()  # rank 0 waits for a peer that died: must not hang the test


def test_run_workers_returns_results_in_rank_order():
    assert run_workers(_all_reduce, 3) == [6.0, 6.0, 6.0]


def test_a_failing_rank_fails_the_test_with_its_traceback_and_no_hang():
    with pytest.raises(RuntimeError, match="boom on rank 1"):
        run_workers(_fails_on_rank_1, 2, timeout=60, pg_timeout=5)
