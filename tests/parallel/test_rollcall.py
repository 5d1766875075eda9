"""The roll call (parallel/rollcall.py) on 3 ranks: a rank that calls it late, but within ROLL_CALL_S, answers and
is not named; one that never calls it is named by every other rank, and only it."""

import time

import torch.distributed as dist

from codraft.parallel.rollcall import ROLL_CALL_S, RollCall
from tests.distributed import run_workers

LATE_S = 2.0  # well inside ROLL_CALL_S


def _roll(rank: int, world_size: int, absent: int | None, late: int | None) -> tuple[list[int], float]:
    roll = RollCall(timeout_s=30)  # ROLL_CALL_S bounds the answers' wait, not timeout_s / 2
    dist.barrier()  # every rank's group is up before anyone calls
    if rank == absent:
        time.sleep(ROLL_CALL_S + 2)  # outlasts the others' wait for its answer
        return [], 0.0
    if rank == late:
        time.sleep(LATE_S)
    start = time.monotonic()
    silent = roll.silent_ranks()
    return silent, time.monotonic() - start


def test_a_rank_that_answers_late_but_within_the_roll_call_is_not_named_on_3_ranks():
    results = run_workers(_roll, 3, None, 2, timeout=60)
    assert [silent for silent, _ in results] == [[], [], []]
    assert all(seconds < ROLL_CALL_S for _, seconds in results), results


def test_a_rank_that_never_answers_is_named_by_each_other_rank_and_alone_on_3_ranks():
    results = run_workers(_roll, 3, 1, 2, timeout=60, awaited=[0, 2])
    assert [silent for silent, _ in results] == [[1], [1]]
    assert all(seconds < ROLL_CALL_S + 1 for _, seconds in results), results
