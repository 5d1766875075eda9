"""The relaunch's torchrun (parallel/torchrun.py): which rank's failure decides the exit code and what is said."""

import signal

import pytest
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

from codraft.parallel.torchrun import first_failure


def _failed(*exitcodes: int) -> ChildFailedError:
    failures = {}
    for rank, code in enumerate(exitcodes):
        failures[rank] = ProcessFailure(local_rank=rank, pid=1000 + rank, exitcode=code, error_file="<N/A>")
        failures[rank].timestamp = rank  # rank 0 failed first
    return ChildFailedError("codraft", failures)


@pytest.mark.parametrize("exitcodes, expected", [
    ((1, -signal.SIGKILL), (1, None)),  # rank 0 timed out and said so; torchrun then killed frozen rank 1
    ((-signal.SIGKILL, 1), (1, None)),  # rank 0 was killed; rank 1's line (lost a peer) names it
    ((2,), (2, None)),  # a user error, said by the rank
    ((-signal.SIGKILL, -signal.SIGTERM),
     (137, "codraft: error: rank 0 was killed by SIGKILL; the other ranks were stopped")),
], ids=["timeout-then-killed", "killed-then-lost-peer", "user-error", "all-killed"])
def test_the_first_rank_that_exited_on_its_own_decides_else_one_line_names_the_killed_one(exitcodes, expected):
    assert first_failure(_failed(*exitcodes)) == expected
