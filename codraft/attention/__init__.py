"""Attention ops with log-sum-exp: packed causal attention, branch attention, the LSE merge."""
