"""The frozen reference policy of the KL term (rl.beta > 0): a copy of the initial policy, or the model at
model.ref_path; none is kept when rl.beta = 0.

It runs in the policy's layout (ring attention under CP) on the same views of a batch, without gradient,
where the loss is computed: on every rank at pp = 1, on the last stage's ranks under PP (whole there, not
split into stages)."""

from __future__ import annotations

import copy

from torch import nn

from codraft.config import Config, ConfigError
from codraft.models import Transformer, load_policy
from codraft.parallel.mesh import ParallelDims
from codraft.parallel.ring_attention import apply_cp


def build_reference(cfg: Config, policy: Transformer, dims: ParallelDims) -> nn.Module | None:
    """The reference of `rl.beta` and `model.ref_path` for this rank (None where no loss is computed)."""
    if cfg.rl.beta == 0 or not dims.is_last_stage:
        return None
    if cfg.model.ref_path is None:
        reference = copy.deepcopy(policy)
    else:
        reference, _ = load_policy(cfg, cfg.model.ref_path)
        if reference.args != policy.args:
            raise ConfigError(f"model.ref_path: {cfg.model.ref_path} is not the architecture of model.path "
                              f"{cfg.model.path} (rl.beta > 0 compares their log-probs token by token)")
    reference.requires_grad_(False).eval()
    return apply_cp(reference, dims)
