"""What one generate call did: acceptance, work, time."""

from __future__ import annotations

from dataclasses import dataclass, field, fields


@dataclass
class RolloutStats:
    rows: int = 0
    tokens_generated: int = 0
    target_forwards: int = 0  # verify/decode forwards after prefill
    row_verifies: int = 0  # sum over forwards of the rows in them
    tokens_from_verifies: int = 0  # tokens emitted by those forwards (1 + accepted per row)
    draft_tokens_proposed: int = 0
    draft_tokens_accepted: int = 0
    proposed_per_position: list[int] = field(default_factory=list)
    accepted_per_position: list[int] = field(default_factory=list)
    k_chosen: list[int] = field(default_factory=list)  # k of each verify step (the most it could draft)
    draft_positions: int = 0  # positions drafted, summed over proposals (<= k: a chain draft may stop early)
    malformed_proposals: int = 0
    time_prefill_s: float = 0.0
    time_draft_s: float = 0.0
    # of time_draft_s, proposals that first absorbed a backlog (the prompt, or tokens committed while speculation
    # was off): prefill-like work, apart from the steady cost of drafting
    time_draft_backlog_s: float = 0.0
    backlog_proposals: int = 0
    time_verify_s: float = 0.0
    time_pack_s: float = 0.0  # re-packing weights that changed since the last call (models/linear.py)
    time_pack_policy_s: float = 0.0  # of time_pack_s, the policy's: a rollout without a draft pays it too
    time_total_s: float = 0.0

    @property
    def acceptance_length(self) -> float:
        """tau: tokens emitted per target forward, per row (1 = no speculation gain)."""
        return self.tokens_from_verifies / max(self.row_verifies, 1)

    @property
    def accept_rate_per_position(self) -> list[float]:
        return [
            a / p if p else 0.0 for a, p in zip(self.accepted_per_position, self.proposed_per_position, strict=True)
        ]

    @property
    def mean_k(self) -> float:
        """The speculative tokens chosen per verify step, on average (0 when none ran)."""
        return sum(self.k_chosen) / max(len(self.k_chosen), 1)

    @property
    def speculative_steps(self) -> int:
        """Verify steps that had drafts to verify (k > 0)."""
        return sum(1 for k in self.k_chosen if k)

    @property
    def drafts_per_step(self) -> float:
        """Positions drafted per speculative step, on average (at most its k: a chain draft may stop early)."""
        return self.draft_positions / max(self.speculative_steps, 1)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_generated / self.time_total_s if self.time_total_s > 0 else 0.0

    def count_positions(self, proposed: list[int], accepted: list[int]) -> None:
        grow = len(proposed) - len(self.proposed_per_position)
        if grow > 0:
            self.proposed_per_position += [0] * grow
            self.accepted_per_position += [0] * grow
        for i, (p, a) in enumerate(zip(proposed, accepted, strict=True)):
            self.proposed_per_position[i] += p
            self.accepted_per_position[i] += a

    def merge(self, other: RolloutStats) -> None:
        """Add `other`'s counts, choices and times to these (several generate calls measured as one)."""
        for f in fields(self):
            if f.name not in ("proposed_per_position", "accepted_per_position"):
                setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))
        self.count_positions(other.proposed_per_position, other.accepted_per_position)

    def summary(self) -> dict[str, float]:
        out = {
            "spec/acceptance_length": self.acceptance_length,
            "spec/draft_tokens": float(self.draft_tokens_proposed),
            "spec/accepted_tokens": float(self.draft_tokens_accepted),
            "rollout/tokens": float(self.tokens_generated),
            "rollout/target_forwards": float(self.target_forwards),
            "rollout/tokens_per_s": self.tokens_per_s,
            "time/pack_s": self.time_pack_s,
            "time/prefill_s": self.time_prefill_s,
            "time/draft_s": self.time_draft_s,
            "time/verify_s": self.time_verify_s,
            "time/generate_s": self.time_total_s,
        }
        out |= {f"spec/accept_rate_pos_{i}": r for i, r in enumerate(self.accept_rate_per_position)}
        return out
