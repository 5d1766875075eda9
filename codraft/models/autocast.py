"""bf16 matmuls for a training forward: a draft's (distillation and co-training) or the policy's.

Weights, optimizer state, losses and gradients stay fp32; under autocast only the matmuls (and attention) take bf16
inputs. Measured on this project's CPU (e2e chain workload, in-process A/Bs, README "End to end"):
- a draft's training forward+backward cost 15.6% of the policy's in fp32 (EAGLE-3, 3 TTT steps, an 8192-token
  head), 9.8% with its matmuls in bf16;
- the policy's whole update (1 x 4 answers of up to 192 tokens, draft term included) took 0.71-0.74x its fp32 time
  with the policy's matmuls in bf16 and its head kept at the weights' precision (`Transformer.logits`), at a
  train/inference KL of 3.8-4.7e-4 against fp32's 2.3e-4 on the same weights and rollout.
The policy's setting (`rl.policy_matmul_dtype`) is float32 by default: its gradients, and a CP/PP layout's match with
one process, are then exactly what they were.
"""

from __future__ import annotations

import torch
from torch import nn

from codraft.models.linear import bf16_native_linear


def training_autocast(module: nn.Module, setting: str) -> torch.autocast:
    """Autocast for `module`'s training forward under a setting auto | float32 | bfloat16 (auto: bfloat16
    where the device has bf16 arithmetic: a CUDA device that supports it, a CPU with AVX-512 BF16 or AMX)."""
    weight = next(module.parameters())
    if setting == "auto":
        native = (torch.cuda.is_bf16_supported() if weight.device.type == "cuda"
                  else weight.device.type == "cpu" and bf16_native_linear())
        setting = "bfloat16" if native else "float32"
    return torch.autocast(weight.device.type, dtype=torch.bfloat16,
                          enabled=setting == "bfloat16" and weight.dtype == torch.float32)
