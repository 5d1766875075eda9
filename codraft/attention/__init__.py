"""Attention ops with log-sum-exp: packed causal attention, branch attention, the LSE merge."""

from codraft.attention.api import branch_attention, causal_attention
from codraft.attention.branches import AttentionOutput, Branches
from codraft.attention.merge import merge_attention

__all__ = ["AttentionOutput", "Branches", "branch_attention", "causal_attention", "merge_attention"]
