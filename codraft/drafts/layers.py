"""Pieces every draft family is built from: tap fusion and a Llama-style draft layer.

The draft layer's projections run outside its attention, because each family
attends differently (EAGLE-3: a chain with TTT branches; DFlash/DSpark: a block
over a context); the layer only owns weights, rotary and the MLP half.
Parameter names follow the policy's (q_proj, ..., mlp.gate_proj) so exports
match the layouts SGLang and vLLM load.
"""

from __future__ import annotations

import torch
from torch import nn

from codraft.models.args import ModelArgs
from codraft.models.linear import FusedLinears, Linear
from codraft.models.model import FeedForward, RMSNorm
from codraft.models.rope import apply_rotary


class TapFusion(nn.Module):
    """concat(taps) [.., n*H] -> fc -> [.., H] (optionally RMSNorm-ed, as DFlash does)."""

    def __init__(self, num_taps: int, hidden_size: int, eps: float, norm: bool):
        super().__init__()
        self.fc = Linear(num_taps * hidden_size, hidden_size, bias=False)
        self.fc.raw_input = True  # the policy's residual stream: no int8 copy (models/linear.py)
        self.norm = RMSNorm(hidden_size, eps) if norm else None

    def forward(self, taps: list[torch.Tensor]) -> torch.Tensor:
        return self.project(torch.cat(taps, dim=-1))

    def project(self, concat: torch.Tensor) -> torch.Tensor:
        """Taps already side by side [.., n*H] -> [.., H]."""
        fused = self.fc(concat)
        return self.norm(fused) if self.norm is not None else fused


class Projections(nn.Module):
    """q/k/v/o projections (and q/k norms) of a draft layer; `context_kv`: also a keys-and-values-only matmul
    (`kv`), for DFlash's context, which is attended to but asks nothing."""

    def __init__(self, args: ModelArgs, in_features: int, context_kv: bool = False):
        super().__init__()
        d = args.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = args.num_heads, args.num_kv_heads, d
        self.q_proj = Linear(in_features, args.num_heads * d, bias=args.attention_bias)
        self.k_proj = Linear(in_features, args.num_kv_heads * d, bias=args.attention_bias)
        self.v_proj = Linear(in_features, args.num_kv_heads * d, bias=args.attention_bias)
        self.o_proj = Linear(args.num_heads * d, args.hidden_size, bias=False)
        self.q_norm = RMSNorm(d, args.rms_norm_eps) if args.qk_norm else None
        self.k_norm = RMSNorm(d, args.rms_norm_eps) if args.qk_norm else None
        self.qkv_group = FusedLinears(self.q_proj, self.k_proj, self.v_proj)
        self.kv_group = FusedLinears(self.k_proj, self.v_proj) if context_kv else None

    def qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """x [..., S, in] -> q [..., S, H, D], k, v [..., S, Hkv, D], rotary applied to q and k."""
        q, k, v = self.qkv_group(x)
        q = q.unflatten(-1, (self.num_heads, self.head_dim))
        q = self.q_norm(q) if self.q_norm is not None else q
        return (apply_rotary(q, cos, sin), *self._kv(k, v, cos, sin))

    def kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [..., S, in] -> k, v [..., S, Hkv, D], rotary applied to k."""
        assert self.kv_group is not None, "built without context_kv"
        return self._kv(*self.kv_group(x), cos, sin)

    def _kv(self, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        k = k.unflatten(-1, (self.num_kv_heads, self.head_dim))
        v = v.unflatten(-1, (self.num_kv_heads, self.head_dim))
        k = self.k_norm(k) if self.k_norm is not None else k
        return apply_rotary(k, cos, sin), v


class DraftLayer(nn.Module):
    """Attention weights + SwiGLU MLP; `finish` is everything after attention."""

    def __init__(self, args: ModelArgs, attn_in_features: int, context_kv: bool = False):
        super().__init__()
        self.self_attn = Projections(args, attn_in_features, context_kv)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.mlp = FeedForward(args)

    def finish(self, attn_out: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """attn_out [..., H, D], residual [..., hidden] -> layer output [..., hidden]."""
        h = residual + self.self_attn.o_proj(attn_out.flatten(-2))
        return h + self.mlp(self.post_attention_layernorm(h))
