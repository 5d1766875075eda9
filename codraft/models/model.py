"""The policy: a Llama / Qwen2 / Qwen3 family decoder in plain PyTorch.

One module serves every use: a packed (varlen) training forward, batched
prefill / decode / verify with a KV cache, and one pipeline stage (a contiguous
range of layers, with or without embedding and head). Any layer's output can
be returned as a "tap" from the same forward.

Module and parameter names follow Hugging Face's, without the `model.` prefix,
so checkpoints map one to one and a stage's state dict is a slice of the full one.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from codraft.models import cpu_kernels
from codraft.models.args import ModelArgs
from codraft.models.cache_attention import CacheMask, cache_attention, cache_mask
from codraft.models.kv_cache import KVCache
from codraft.models.linear import FusedLinears, Linear
from codraft.models.rope import RotaryEmbedding, apply_rotary

# (q [T, H, D], k [T, Hkv, D], v [T, Hkv, D], cu_seqlens [N+1]) -> out [T, H, D]
PackedAttention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def tokens_first_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      mask: torch.Tensor | None = None) -> torch.Tensor:
    """SDPA of [L, H, D] queries over [S, Hkv, D] keys and values under a bool mask [L, S] (None: causal)."""
    q, k, v = (t.transpose(0, 1) for t in (q, k, v))  # [H, L, D]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None,
                                          enable_gqa=True).transpose(0, 1)


def packed_causal_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Causal attention within each packed sequence, one SDPA call per sequence."""
    out = torch.empty_like(q)
    bounds = cu_seqlens.tolist()
    for start, end in zip(bounds[:-1], bounds[1:], strict=True):
        out[start:end] = tokens_first_sdpa(q[start:end], k[start:end], v[start:end])
    return out


def packed_positions(cu_seqlens: torch.Tensor) -> torch.Tensor:
    """[T] position of each packed token within its own sequence."""
    steps = torch.arange(int(cu_seqlens[-1]), device=cu_seqlens.device)
    return steps - cu_seqlens[:-1].repeat_interleave(cu_seqlens.diff())


@dataclass
class ModelOutput:
    logits: torch.Tensor | None  # [B, S, V]; None for a stage without head
    hidden: torch.Tensor  # [B, S, hidden] residual stream after the last layer (before the final norm)
    taps: dict[int, torch.Tensor] = field(default_factory=dict)  # layer id -> [B, S, hidden]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == self.weight.dtype == torch.float32 and x.device.type == "cpu":
            if not torch.is_grad_enabled() and cpu_kernels.cpu_kernels() is not None:  # one call, not six ops
                return cpu_kernels.rms_norm(x, self.weight, self.eps)
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)  # one op, the same bits (test)
        xf = x.float()  # normalise in fp32 as HF does, scale in the input dtype
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = args.num_heads, args.num_kv_heads, args.head_dim
        h, d = args.hidden_size, args.head_dim
        self.q_proj = Linear(h, args.num_heads * d, bias=args.attention_bias)
        self.k_proj = Linear(h, args.num_kv_heads * d, bias=args.attention_bias)
        self.v_proj = Linear(h, args.num_kv_heads * d, bias=args.attention_bias)
        self.o_proj = Linear(args.num_heads * d, h, bias=False)
        self.qkv = FusedLinears(self.q_proj, self.k_proj, self.v_proj)
        self.q_norm = RMSNorm(d, args.rms_norm_eps) if args.qk_norm else None
        self.k_norm = RMSNorm(d, args.rms_norm_eps) if args.qk_norm else None
        self.packed_attention: PackedAttention = packed_causal_sdpa  # parallelisms swap this from outside

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx: _AttentionContext) -> torch.Tensor:
        B, S = ctx.batch_shape
        q, k, v = (ctx.expand(t) for t in self.qkv(x))
        q = q.view(B, S, self.num_heads, self.head_dim)
        k = k.view(B, S, self.num_kv_heads, self.head_dim)
        v = v.view(B, S, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)

        if ctx.cu_seqlens is not None:  # packed: [1, T, ...]
            out = self.packed_attention(q[0], k[0], v[0], ctx.cu_seqlens).unsqueeze(0)
            return self.o_proj(out.reshape(B, S, -1))

        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [B, H, S, D]
        if ctx.cache is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        else:
            ctx.cache.write(ctx.layer_slot, ctx.positions, k, v)
            keys = ctx.cache.k[ctx.layer_slot, :, :, : ctx.kv_len]
            values = ctx.cache.v[ctx.layer_slot, :, :, : ctx.kv_len]
            out = cache_attention(q, keys, values, ctx.mask)
        return self.o_proj(ctx.compact(out.transpose(1, 2).reshape(B, S, -1)))


class FeedForward(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.gate_proj = Linear(args.hidden_size, args.intermediate_size, bias=False)
        self.up_proj = Linear(args.hidden_size, args.intermediate_size, bias=False)
        self.down_proj = Linear(args.intermediate_size, args.hidden_size, bias=False)
        self.gate_up = FusedLinears(self.gate_proj, self.up_proj)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.self_attn = Attention(args)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.mlp = FeedForward(args)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx: _AttentionContext) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, ctx)
        return x + self.mlp(self.post_attention_layernorm(x))


@dataclass
class _AttentionContext:
    """What attention needs besides q/k/v, computed once per forward."""

    positions: torch.Tensor  # [B, S]
    batch_shape: tuple[int, int]  # (B, S) of the forward's inputs
    active: torch.Tensor | None = None  # flat indices into B * S of the tokens computed; None = all of them
    cu_seqlens: torch.Tensor | None = None
    cache: KVCache | None = None
    kv_len: int = 0  # cache columns that any query of this forward may see
    mask: CacheMask | None = None  # which of the kv_len cache columns each query sees
    layer_slot: int = 0  # index of the current layer inside the cache

    def compact(self, x: torch.Tensor) -> torch.Tensor:
        """[B, S, F] -> [1, N, F], the active tokens' rows (x itself when all are active)."""
        return x if self.active is None else x.reshape(-1, x.shape[-1]).index_select(0, self.active)[None]

    def expand(self, x: torch.Tensor) -> torch.Tensor:
        """[1, N, F] of the active tokens -> [B, S, F], zero at the others (x itself when all are active)."""
        if self.active is None:
            return x
        full = x.new_zeros(self.batch_shape[0] * self.batch_shape[1], x.shape[-1]).index_copy_(0, self.active, x[0])
        return full.view(*self.batch_shape, -1)


class Transformer(nn.Module):
    """The whole decoder, or the pipeline stage holding layers [first_layer, last_layer).

    `embed`/`head` default to whether the stage starts at layer 0 / ends at the last layer.
    `inference_dtype` is the dtype of the packed copies its rollout matmuls run on (None: the weights' own;
    `load_policy` sets `model.inference_dtype`); the head always runs in the weights' dtype.
    """

    inference_dtype: torch.dtype | None = None

    def __init__(
        self,
        args: ModelArgs,
        *,
        layers: tuple[int, int] | None = None,
        embed: bool | None = None,
        head: bool | None = None,
    ):
        super().__init__()
        self.args = args
        self.first_layer, self.last_layer = layers or (0, args.num_layers)
        if not 0 <= self.first_layer < self.last_layer <= args.num_layers:
            raise ValueError(f"layers={layers} is not a non-empty range within [0, {args.num_layers})")
        embed = self.first_layer == 0 if embed is None else embed
        head = self.last_layer == args.num_layers if head is None else head

        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size) if embed else None
        self.layers = nn.ModuleDict({str(i): DecoderLayer(args) for i in range(self.first_layer, self.last_layer)})
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps) if head else None
        self.lm_head = Linear(args.hidden_size, args.vocab_size, bias=False) if head else None
        if head and embed and args.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        if head:  # logits and log-probs (the sampled distribution, RL's inference log-probs) at full precision
            self.lm_head.keep_dtype = True
        self.rotary = RotaryEmbedding(args)

    def init_buffers(self, device: torch.device | str) -> None:
        """(Re)build non-persistent buffers, e.g. after materialising a model built on the meta device."""
        self.rotary = RotaryEmbedding(self.args).to(device)

    @property
    def layer_ids(self) -> range:
        return range(self.first_layer, self.last_layer)

    def new_cache(self, batch_size: int, max_len: int) -> KVCache:
        param = next(self.parameters())
        return KVCache(
            self.args, batch_size, max_len, num_layers=len(self.layers), dtype=param.dtype, device=param.device
        )

    def forward(
        self,
        inputs: torch.Tensor,
        *,
        positions: torch.Tensor | None = None,
        cu_seqlens: torch.Tensor | None = None,
        cache: KVCache | None = None,
        taps: Iterable[int] = (),
        compute_logits: bool = True,
        logit_rows: torch.Tensor | None = None,
        active: torch.Tensor | None = None,
    ) -> ModelOutput:
        """Run the stage.

        inputs: token ids [B, S] (stage with embedding) or hidden states [B, S, hidden].
        cu_seqlens: packed mode, B == 1 and attention is causal within each sequence.
        cache: positions default to `cache.lengths[:, None] + arange(S)`; the cache's
            lengths are NOT advanced here — the caller decides what to keep.
        taps: layer ids whose outputs to return; ids outside this stage are ignored.
        logit_rows: positions [R] along S; the head runs on them only and the other rows of the logits are 0.
        active: flat indices [N] into the B * S tokens (with a cache): only they run through the layers and
            the head, so a verify step whose rows bring fewer drafts than others pays for the tokens it has.
            The others' rows of logits, hidden and taps are 0 and their cache slots junk, so they must lie past
            what the caller keeps of each row (causal attention keeps them out of the active tokens' outputs).
        """
        x = self.embed_tokens(inputs) if self.embed_tokens is not None else inputs
        B, S = x.shape[:2]
        positions = self._positions(B, S, x.device, cu_seqlens, cache) if positions is None else positions
        ctx = _AttentionContext(positions=positions, batch_shape=(B, S), cu_seqlens=cu_seqlens, cache=cache)
        if active is not None:
            assert cache is not None and logit_rows is None, "active tokens are for cached (decode/verify) forwards"
            ctx.active = active
            x = ctx.compact(x)
        if cache is not None:
            ctx.kv_len = int(positions.max()) + 1
            visible = torch.arange(ctx.kv_len, device=x.device) <= positions[..., None]  # [B, S, kv_len]
            ctx.mask = cache_mask(visible, S, self.args, x.dtype)
        cos, sin = self.rotary(positions, x.dtype)

        wanted = set(taps)
        tapped: dict[int, torch.Tensor] = {}
        for slot, (name, layer) in enumerate(self.layers.items()):
            ctx.layer_slot = slot
            x = layer(x, cos, sin, ctx)
            if int(name) in wanted:
                tapped[int(name)] = ctx.expand(x)
        logits = None
        if self.lm_head is not None and compute_logits:
            logits = ctx.expand(self.logits(x)) if logit_rows is None else self.logits_at(x, logit_rows)
        return ModelOutput(logits=logits, hidden=ctx.expand(x), taps=tapped)

    def logits_at(self, x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """Logits [B, S, V] of states x [B, S, H] computed at positions `rows` along S, zero elsewhere."""
        part = self.logits(x.index_select(1, rows))  # [B, R, V]
        return part.new_zeros(*x.shape[:2], part.shape[-1]).index_copy(1, rows, part)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm + head over residual-stream states [..., hidden], at the weights' precision also under a
        training forward's autocast (rl.policy_matmul_dtype): log-probs are RL's ratios and importance weights."""
        if torch.is_autocast_enabled(hidden.device.type):  # a training forward's: the head runs outside it
            with torch.autocast(hidden.device.type, enabled=False):
                return self.logits(hidden.to(self.norm.weight.dtype))
        return self.lm_head(self.norm(hidden))

    @staticmethod
    def _positions(
        B: int, S: int, device: torch.device, cu_seqlens: torch.Tensor | None, cache: KVCache | None
    ) -> torch.Tensor:
        if cu_seqlens is not None:
            assert B == 1 and int(cu_seqlens[-1]) == S, "packed inputs are [1, T] with cu_seqlens ending at T"
            return packed_positions(cu_seqlens).unsqueeze(0)
        steps = torch.arange(S, device=device)
        if cache is not None:
            return cache.lengths[:, None] + steps
        return steps.expand(B, S)
