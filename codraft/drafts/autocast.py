"""bf16 matmuls for a draft's training forward (distillation and co-training).

A draft is small next to its policy, but on this project's CPU its training forward+backward cost 15.6% of
the policy's on the e2e chain workload in fp32 (EAGLE-3, 3 TTT steps, an 8192-token head), against 9.8%
with its matmuls autocast to bf16 (an in-process A/B, README "End to end"). Weights, optimizer state, losses
and the attention kernels (drafts/base.py) stay fp32; the policy never runs under it, so its gradients do not
change.
"""

from __future__ import annotations

import torch
from torch import nn

from codraft.models.linear import packed_dtype


def training_autocast(draft: nn.Module, setting: str) -> torch.autocast:
    """Autocast for the draft's training forward under a setting auto | float32 | bfloat16 (auto: bfloat16
    where the device has bf16 arithmetic: a CUDA device that supports it, a CPU with AVX-512 BF16 or AMX)."""
    weight = next(draft.parameters())
    if setting == "auto":
        native = (torch.cuda.is_bf16_supported() if weight.device.type == "cuda"
                  else packed_dtype("auto", weight.dtype) == torch.bfloat16)
        setting = "bfloat16" if native else "float32"
    return torch.autocast(weight.device.type, dtype=torch.bfloat16,
                          enabled=setting == "bfloat16" and weight.dtype == torch.float32)
