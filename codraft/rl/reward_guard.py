"""A run whose reward function fails on most samples trains on nothing: stop it, naming the function's error."""

from __future__ import annotations

from codraft.config import ConfigError, RLConfig


class RewardGuard:
    """Counts consecutive steps in which more than `rl.max_dropped_share` of the samples were dropped (the reward
    function raised, or returned a non-number or a non-finite value); `rl.max_dropped_steps` of them in a row
    stop the run (0: never)."""

    def __init__(self, spec: str, rl: RLConfig):
        self.spec, self.max_share, self.max_steps = spec, rl.max_dropped_share, rl.max_dropped_steps
        self.streak, self.first_error = 0, None

    def exceeded(self, dropped: int, total: int, errors: list[str]) -> bool:
        """Count this step's `dropped` of `total` samples (`errors`: why, in order); True once the limit is hit."""
        if dropped > self.max_share * total:
            self.streak += 1
            self.first_error = self.first_error or (errors[0] if errors else None)
        else:
            self.streak, self.first_error = 0, None
        return self.max_steps > 0 and self.streak >= self.max_steps

    def failure(self) -> ConfigError:
        first = self.first_error or "seen on another data-parallel replica"
        return ConfigError(
            f"task.reward: the reward function {self.spec!r} dropped more than {self.max_share:.0%} of the samples "
            f"for {self.max_steps} consecutive steps (rl.max_dropped_share, rl.max_dropped_steps), so the run trains "
            f"on nothing; its first error: {first}"
        )
