"""Rollout generation: plain and lossless speculative decoding, drafters, adaptive speculation."""

from codraft.rollout.adaptive import SpeculationController
from codraft.rollout.drafter import Drafter, Proposal
from codraft.rollout.engine import Rollout, generate
from codraft.rollout.sampling import SamplingParams
from codraft.rollout.stats import RolloutStats

__all__ = ["Drafter", "Proposal", "Rollout", "RolloutStats", "SamplingParams", "SpeculationController", "generate"]
