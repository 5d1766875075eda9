"""Drafters without learned weights; learned drafts live in codraft.drafts."""

from codraft.rollout.drafters.ngram import NgramDrafter
from codraft.rollout.drafters.prev_rollout import PreviousRolloutDrafter

__all__ = ["NgramDrafter", "PreviousRolloutDrafter"]
