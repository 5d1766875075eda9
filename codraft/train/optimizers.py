"""AdamW with linear warm-up, for the policy (the part of it this rank trains) and the draft."""

from __future__ import annotations

from collections.abc import Iterable

import torch


def warmup(steps: int):
    return lambda step: min(1.0, (step + 1) / steps) if steps else 1.0


def build_optimizer(params: Iterable[torch.nn.Parameter], lr: float, weight_decay: float, warmup_steps: int,
                    ) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, warmup(warmup_steps))


def step_and_zero(opt: torch.optim.Optimizer, sched: torch.optim.lr_scheduler.LRScheduler) -> None:
    """One optimizer step, its schedule's step, gradients cleared."""
    opt.step()
    sched.step()
    opt.zero_grad(set_to_none=True)
