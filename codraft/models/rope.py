"""Rotary position embeddings, with the rope-scaling variants Llama and Qwen ship.

cos/sin are computed on the fly from integer positions (in fp32, as Hugging Face
does), so packed sequences, CP shards and KV-cache rows with their own lengths
all just pass their own position ids.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from codraft.models.args import ModelArgs


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    factor = scaling["factor"]
    low_freq_factor = scaling.get("low_freq_factor", 1.0)
    high_freq_factor = scaling.get("high_freq_factor", 4.0)
    old_context = scaling.get("original_max_position_embeddings", 8192)
    low_freq_wavelen = old_context / low_freq_factor
    high_freq_wavelen = old_context / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    # long wavelengths are interpolated, short ones kept, the band in between blended
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, blended, scaled)


def _yarn_inv_freq(args: ModelArgs, scaling: dict) -> tuple[torch.Tensor, float]:
    dim, base = args.head_dim, args.rope_theta
    original_max = scaling.get("original_max_position_embeddings") or args.max_position_embeddings
    factor = scaling.get("factor") or args.max_position_embeddings / original_max

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        if scaling.get("mscale") and scaling.get("mscale_all_dim"):
            attention_factor = mscale(factor, scaling["mscale"]) / mscale(factor, scaling["mscale_all_dim"])
        else:
            attention_factor = mscale(factor)
    beta_fast = scaling.get("beta_fast") or 32
    beta_slow = scaling.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original_max / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    extrapolation = 1 - ramp  # 1 where frequencies are kept as trained
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attention_factor)


def rope_frequencies(args: ModelArgs) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [head_dim // 2] and the cos/sin scale (yarn's attention factor)."""
    dim, scaling = args.head_dim, args.rope_scaling or {}
    inv_freq = 1.0 / (args.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    if args.rope_type == "linear":
        return inv_freq / scaling["factor"], 1.0
    if args.rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, scaling), 1.0
    if args.rope_type == "yarn":
        return _yarn_inv_freq(args, scaling)
    return inv_freq, 1.0


class RotaryEmbedding(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        inv_freq, self.attention_factor = rope_frequencies(args)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [...] int -> cos, sin [..., 1, head_dim] in `dtype` (broadcasting over heads), sin's first half
        negated: the tables `apply_rotary` takes, built once per forward for every layer."""
        freqs = positions.float().unsqueeze(-1) * self.inv_freq
        cos, sin = freqs.cos() * self.attention_factor, freqs.sin() * self.attention_factor
        return torch.cat((cos, cos), -1).unsqueeze(-2).to(dtype), torch.cat((-sin, sin), -1).unsqueeze(-2).to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [..., S, H, D] rotated by the tables of `RotaryEmbedding` [..., S, 1, D].

    HF's x * cos + rotate_half(x) * sin with rotate_half(x) = cat(-x2, x1), bit for bit: x.roll(D / 2) is
    cat(x2, x1) and the sign sits in the table. Four ops instead of eight, in every layer of every decode step."""
    return x * cos + x.roll(x.shape[-1] // 2, -1) * sin
