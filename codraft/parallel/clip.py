"""One gradient-norm clip for the policy and the draft, correct across pipeline stages.

The norm is that of every gradient of the model, wherever it lives: each rank's local norm (as
`torch.nn.utils.clip_grad_norm_` computes it), squared and summed over `group` (the pipeline's stages,
each holding a disjoint part), then every gradient is scaled by min(1, max_norm / (norm + 1e-6)).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.distributed as dist


def clip_grad_norm_(params: Iterable[torch.nn.Parameter], max_norm: float, *,
                    counted: Iterable[torch.nn.Parameter] | None = None,
                    group: dist.ProcessGroup | None = None) -> float:
    """Scale the gradients of `params` in place; returns the total norm before clipping. `counted`: the
    parameters whose gradients enter the norm (default `params`; a tied head's second copy is left out);
    `group`: the ranks that hold the model's other parts (None: this rank holds all of it). max_norm 0 = off."""
    grads = [p.grad for p in params if p.grad is not None]
    norms_of = grads if counted is None else [p.grad for p in counted if p.grad is not None]
    device = grads[0].device if grads else torch.device("cpu")
    norm = (torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in norms_of]))
            if norms_of else torch.zeros((), device=device))
    if group is not None:
        square = norm.float().square()
        dist.all_reduce(square, group=group)
        norm = square.sqrt()
    scale = ((max_norm or math.inf) / (norm + 1e-6)).clamp(max=1.0)
    for g in grads:
        g.mul_(scale.to(g.dtype))
    return float(norm)
