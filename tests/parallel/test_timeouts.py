"""Bounded waits: a rank frozen with SIGSTOP makes the others fail within parallel.timeout_s (plus the roll call)
with one line naming it and what they waited for, exit code 1, no traceback."""

import contextlib
import io
import os
import signal
import subprocess
import sys
import time

import pytest

from codraft.cli import main
from codraft.parallel.mesh import ParallelDims
from codraft.parallel.rollcall import RankTimeout
from codraft.parallel.tapchannel import TapChannel
from codraft.train.trainer import Trainer
from tests.distributed import free_port, run_workers
from tests.train.test_trainer_cp import TINY
from tests.train.test_trainer_pp import EAGLE3_EXACT

TIMEOUT_S = 3


def _freeze_when(rank: int, frozen: int, where: str) -> None:
    """On rank `frozen`: SIGSTOP this process at the start of step 2 (the rollout: its peer waits in a broadcast)
    or in its first TapChannel post (the draft stage waits for activations or taps)."""
    if rank != frozen:
        return
    freeze = lambda *args, **kwargs: os.kill(os.getpid(), signal.SIGSTOP)  # noqa: E731
    if where == "tapchannel":
        TapChannel.post = freeze
        return
    step = Trainer.train_step

    def train_step(self):
        if self.step == 1:
            freeze()
        return step(self)

    Trainer.train_step = train_step


def _train_with_a_frozen_rank(rank: int, world_size: int, frozen: int, where: str, overrides: list[str]):
    _freeze_when(rank, frozen, where)
    err = io.StringIO()
    start = time.monotonic()
    with contextlib.redirect_stderr(err):
        code = main(["train", *overrides])
    return code, err.getvalue(), time.monotonic() - start


@pytest.mark.parametrize("frozen, where, waited_in", [
    (1, "rollout", "waited parallel.timeout_s=3 s in torch.distributed broadcast from "),
    (0, "tapchannel", "waited parallel.timeout_s=3 s in torch.distributed _wait_batch_p2p from "),
], ids=["rank1-in-rollout", "rank0-in-tapchannel"])
def test_a_frozen_rank_fails_its_peer_within_the_timeout_with_one_line_naming_it(tmp_path, frozen, where, waited_in):
    overrides = [*TINY, *EAGLE3_EXACT, "parallel.pp=2", f"parallel.timeout_s={TIMEOUT_S}", "rl.steps=3",
                 f"run.dir={tmp_path}"]
    survivor = 1 - frozen
    start = time.monotonic()
    [(code, err, seconds)] = run_workers(_train_with_a_frozen_rank, 2, frozen, where, overrides, timeout=90,
                                         pg_timeout=TIMEOUT_S, awaited=[survivor])
    assert code == 1, err
    assert "Traceback" not in err
    [line] = [line for line in err.splitlines() if "error" in line.lower()]
    assert line.startswith(f"codraft: error: rank {survivor} ")
    assert line.endswith(f"rank {frozen} did not answer a roll call (frozen, stalled or dead)")
    assert waited_in in line or "TapChannel timeout" in line, line
    assert seconds < 40, seconds
    assert time.monotonic() - start < 80  # the helper SIGKILLed the frozen rank: nothing left to wait for


def test_a_rank_whose_peers_never_join_fails_within_the_timeout_with_one_line(tmp_path):
    """Rank 0 of 2 launched alone: the process group cannot form, and the rendezvous gives up after timeout_s."""
    env = os.environ | {"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                        "MASTER_PORT": str(free_port())}
    cmd = [sys.executable, "-m", "codraft", "train", *TINY, "draft.family=none", "parallel.pp=2",
           f"parallel.timeout_s={TIMEOUT_S}", f"run.dir={tmp_path}"]
    start = time.monotonic()
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 1, done.stderr
    line = done.stderr.splitlines()[-1]
    assert line.startswith("codraft: error: rank 0: the process group of 2 ranks did not form within "
                           f"parallel.timeout_s={TIMEOUT_S} s: Timed out after "), line
    assert line.endswith("seconds waiting for clients. 1/2 clients joined."), line
    assert "Traceback" not in done.stderr
    assert time.monotonic() - start < 40


def freezing_reward(completion: str, problem) -> float:
    """A reward that freezes torchrun's rank 1 (SIGSTOP) the first time it runs: rank 0 then waits for it."""
    if os.environ.get("RANK") == "1":
        os.kill(os.getpid(), signal.SIGSTOP)
    return len(completion) / 10


def test_a_relaunched_run_whose_rank_freezes_ends_with_one_line_and_exit_code_1(tmp_path):
    """`codraft train parallel.pp=2` relaunches itself under torchrun: rank 0's one line is all the user sees, not
    torchrun's ChildFailedError traceback and table, nor its warnings about stopping the frozen rank."""
    cmd = [sys.executable, "-m", "codraft", "train", *TINY, "draft.family=none", "parallel.pp=2",
           f"parallel.timeout_s={TIMEOUT_S}", "rl.steps=3", f"task.reward={__name__}:freezing_reward",
           f"run.dir={tmp_path}"]
    env = os.environ | {"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "2"}  # torchrun's wait before it SIGKILLs the frozen rank
    start = time.monotonic()
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr and "ChildFailedError" not in done.stderr, done.stderr
    assert "torch/distributed/elastic" not in done.stderr, done.stderr  # torchrun's own warnings
    [line] = [line for line in done.stderr.splitlines() if "error" in line.lower()]
    assert line.startswith("codraft: error: rank 0 waited parallel.timeout_s=3 s in torch.distributed "), line
    assert line.endswith("rank 1 did not answer a roll call (frozen, stalled or dead)"), line
    assert time.monotonic() - start < 100


def _build_the_mesh_without_rank_1(rank: int, world_size: int) -> tuple[str, float]:
    if rank == 1:  # stalls before ParallelDims.build (killed by the helper once rank 0 is done)
        time.sleep(60)
    start = time.monotonic()
    with pytest.raises(RankTimeout) as e:
        ParallelDims(1, 2, 1, 2).build(timeout_s=TIMEOUT_S)
    return str(e.value), time.monotonic() - start


def test_a_mesh_whose_rank_never_builds_it_fails_within_the_timeout_with_one_line():
    [(message, seconds)] = run_workers(_build_the_mesh_without_rank_1, 2, timeout=60, pg_timeout=TIMEOUT_S,
                                       awaited=[0])
    assert message.startswith(f"rank 0: the mesh's process groups did not form within parallel.timeout_s={TIMEOUT_S} "
                              "s (a rank did not reach ParallelDims.build): "), message
    assert "\n" not in message
    assert seconds < 4 * TIMEOUT_S, seconds
