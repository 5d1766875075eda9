"""Data parallelism's share of the prompts: replica r of dp takes its slice of every step's draw, so the
replicas see different prompts and, together, the stream a single run of dp times the prompts would see."""

from __future__ import annotations

from typing import Any

from codraft.rl.tasks import IndexedTask, Problem


class ReplicaTask:
    """`task` as seen by data-parallel replica `rank` of `dp`: every replica draws dp * n problems (all advance
    the same position, so checkpoints stay replica-independent) and keeps its n."""

    def __init__(self, task: IndexedTask, rank: int, dp: int):
        assert 0 <= rank < dp, (rank, dp)
        self.task, self.rank, self.dp = task, rank, dp

    def sample(self, n: int) -> list[Problem]:
        return self.task.sample(n * self.dp)[self.rank * n : (self.rank + 1) * n]

    def state_dict(self) -> dict[str, int]:
        return self.task.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.task.load_state_dict(state)
