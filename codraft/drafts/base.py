"""What the three draft families share: the training batch, the model interface,
and the drafter that keeps a draft in step with the rollout engine.

Interface (DESIGN.md "Contracts"):
    draft.tap_layers                   policy layers the draft reads (set from the config)
    draft.loss(batch) -> (loss, metrics)   training on packed rollout tokens, taps detached
    draft.drafter() -> Drafter         plugs into codraft.rollout.generate
    draft.attention_op                 the training attention, swapped from outside (parallel/cp_draft.py)
"""

from __future__ import annotations

from collections.abc import Callable
from copy import deepcopy
from dataclasses import dataclass, field, replace
from typing import Literal

import torch
from torch import nn

from codraft.attention import AttentionOutput, Branches, branch_attention
from codraft.config import DraftConfig
from codraft.drafts.layers import TapFusion
from codraft.drafts.shard import TokenShard
from codraft.models import KVCache, ModelArgs, Transformer
from codraft.models.cache_attention import CacheMask
from codraft.models.cache_attention import cache_attention as attend_cache
from codraft.models.kv_cache import take_rows
from codraft.models.linear import packed_dtype
from codraft.models.model import packed_positions
from codraft.rollout.drafter import Drafter, Proposal, right_padded
from codraft.rollout.sampling import SamplingParams


@dataclass
class DraftBatch:
    """A packed batch of rollout tokens with the policy's detached outputs, token-major.

    The tensors are the tokens this rank computes on (all of them on one device, its zigzag share
    under CP); `shard` places them in the whole batch, for what a draft reads ahead (drafts/shard.py).
    """

    input_ids: torch.Tensor  # [T]
    taps: dict[int, torch.Tensor]  # policy layer -> [T, H], detached
    policy_logits: torch.Tensor  # [T, V], detached; row t is the policy's prediction of token t+1
    loss_mask: torch.Tensor  # [T] bool: token t is a response token, i.e. one the draft should predict
    cu_seqlens: torch.Tensor  # [N+1]
    positions: torch.Tensor | None = None  # [T] rotary positions; default per-sequence arange
    shard: TokenShard | None = None  # default: this batch is the whole batch
    # policy_logits holds the draft's `policy_rows` of the policy's rows ([T, W]), as the distillation cache stores
    policy_reduced: bool = False

    def __post_init__(self):
        if self.shard is None:
            self.shard = TokenShard(self.input_ids, self.loss_mask.bool(), self.cu_seqlens)

    def rope_positions(self) -> torch.Tensor:
        if self.positions is not None:
            return self.positions
        return packed_positions(self.cu_seqlens)


# (q [T, H, D] | None, k/v [T, Hkv, D], cu_seqlens [N+1], branches | None) -> AttentionOutput
AttentionOp = Callable[[torch.Tensor | None, torch.Tensor, torch.Tensor, torch.Tensor, Branches | None],
                       AttentionOutput]


class DraftModel(nn.Module):
    """Base of EAGLE-3, DFlash and DSpark.

    The policy's embedding (and, for DFlash/DSpark, its head) are borrowed, not
    owned: `attach(policy)` keeps detached views of them, so they are frozen for
    the draft, absent from its parameters and state dict, and always the policy's
    current weights (optimizer steps update them in place).

    Training attention goes through `attention`: the family's single-device `branch_attention`
    unless a parallelism set `attention_op` from outside (the draft never asks which).
    """

    family: str = ""
    # the loss reads every column of the policy's rows (`policy_rows` is the identity): the distillation cache then
    # keeps the policy's hidden states, not V log-probs a row (distill/distill.py)
    reads_whole_vocabulary = True
    attention_op: AttentionOp | None = None
    # "fused" (CPU kernels) or "dense"; None picks fused on CPU, dense elsewhere (no GPU kernel yet)
    attention_impl: Literal["fused", "dense"] | None = None

    def __init__(self, cfg: DraftConfig, policy_args: ModelArgs, default_taps: list[int], fusion_norm: bool):
        super().__init__()
        cfg.validate(policy_args.num_layers, policy_args.vocab_size)
        self.cfg, self.policy_args = cfg, policy_args
        self.tap_layers: tuple[int, ...] = tuple(cfg.tap_layers if cfg.tap_layers is not None else default_taps)
        self.fusion = TapFusion(len(self.tap_layers), policy_args.hidden_size, policy_args.rms_norm_eps, fusion_norm)
        self._embed: torch.Tensor | None = None
        self._head: torch.Tensor | None = None
        self._head_module: tuple[nn.Module, ...] = ()  # the policy's lm_head, unregistered (not a submodule)

    def attach(self, policy: Transformer) -> DraftModel:
        """Borrow the policy's embedding and head (detached views sharing storage)."""
        head = policy.lm_head.weight if policy.lm_head is not None else None
        embed = policy.embed_tokens.weight if policy.embed_tokens is not None else None
        if embed is None and self.policy_args.tie_word_embeddings:
            embed = head  # a last PP stage of a tied model embeds with its head weight
        self._embed = embed.detach() if embed is not None else None
        self._head = head.detach() if head is not None else None
        self._head_module = (policy.lm_head,) if policy.lm_head is not None else ()
        return self

    def frozen_copy(self) -> DraftModel:
        """A copy of this draft's own weights and buffers, without gradients, that borrows the same policy weights
        (the current policy's embedding and head, as this draft does): the never-updated control that
        `rl.frozen_draft_every` scores beside the trained draft."""
        borrowed = [t for t in (self._embed, self._head, *self._head_module) if t is not None]
        copy = deepcopy(self, memo={id(t): t for t in borrowed})
        return copy.requires_grad_(False)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        assert self._embed is not None, "call draft.attach(policy) first"
        return nn.functional.embedding(ids, self._embed)

    def policy_head(self, hidden: torch.Tensor) -> torch.Tensor:
        assert self._head is not None, "call draft.attach(policy) first"
        if self._head_module and not torch.is_grad_enabled():  # inference: the policy's module, packed weight
            return self._head_module[0](hidden)
        return nn.functional.linear(hidden, self._head)

    @property
    def inference_dtype(self) -> torch.dtype:
        """The dtype of the packed copies the draft's rollout matmuls run on (`draft.inference_dtype`)."""
        return packed_dtype(self.cfg.inference_dtype, self.fusion.fc.weight.dtype)

    def fuse(self, taps: dict[int, torch.Tensor]) -> torch.Tensor:
        return self.fusion.project(self.concat_taps(taps))

    def concat_taps(self, taps: dict[int, torch.Tensor]) -> torch.Tensor:
        """The taps side by side [..., n_taps * H], in fusion order (what `fusion.project` reads)."""
        return torch.cat([taps[i] for i in self.tap_layers], dim=-1)

    def attention(self, q, k, v, cu_seqlens, branches: Branches | None = None) -> AttentionOutput:
        if torch.is_autocast_enabled(k.device.type):  # the attention kernels take one dtype: run them in fp32
            q, k, v = (t.float() if t is not None else None for t in (q, k, v))
            if branches is not None:
                branches = replace(branches, q=branches.q.float(), k=branches.k.float(), v=branches.v.float())
            with torch.autocast(k.device.type, enabled=False):
                return (self.attention_op or self.default_attention)(q, k, v, cu_seqlens, branches)
        return (self.attention_op or self.default_attention)(q, k, v, cu_seqlens, branches)

    def default_attention(self, q, k, v, cu_seqlens, branches: Branches | None) -> AttentionOutput:
        """Single-device branch attention with `attention_impl`'s kernels."""
        impl = self.attention_impl or ("fused" if k.device.type == "cpu" else "dense")
        return branch_attention(q, k, v, cu_seqlens, branches, impl=impl)

    def policy_rows(self, logits: torch.Tensor) -> torch.Tensor:
        """What the loss reads of the policy's rows [..., V] (all of them here: DFlash and DSpark train over the
        whole vocabulary). The distillation cache keeps only this, so a family that reads less stores less."""
        return logits

    def loss(self, batch: DraftBatch) -> tuple[torch.Tensor, dict[str, float]]:
        raise NotImplementedError

    def drafter(self) -> LearnedDrafter:
        return LearnedDrafter(self)

    # --- export (codraft/drafts/export.py writes config.json + model.safetensors) ---
    def export_config(self) -> dict:
        """config.json of the exported draft (must let `from_export` rebuild it)."""
        raise NotImplementedError

    def layer_export_config(self) -> dict:
        """The keys every family's config.json shares: the draft layers' shapes (HF names) and the policy's
        vocabulary."""
        a = self.layer_args
        return {
            "hidden_size": a.hidden_size,
            "intermediate_size": a.intermediate_size,
            "num_attention_heads": a.num_heads,
            "num_key_value_heads": a.num_kv_heads,
            "head_dim": a.head_dim,
            "rms_norm_eps": a.rms_norm_eps,
            "rope_theta": a.rope_theta,
            "rope_scaling": a.rope_scaling,
            "max_position_embeddings": a.max_position_embeddings,
            "vocab_size": self.policy_args.vocab_size,
            "attention_bias": False,
            "torch_dtype": str(self.fusion.fc.weight.dtype).removeprefix("torch."),
        }

    @staticmethod
    def check_policy_fit(config: dict, fits: dict[str, int], required: bool = True) -> None:
        """ValueError unless the exported config's `fits` keys hold the policy's values (a key the config lacks
        fails when `required`, else passes)."""
        for key, have in fits.items():
            if config.get(key, None if required else have) != have:
                raise ValueError(f"draft config {key}={config.get(key)} does not fit the policy's {key}={have}")

    @staticmethod
    def check_taps_fit(taps: list[int], key: str, num_layers: int) -> list[int]:
        """`taps`, the exported config's `key`, when they are layers of the policy; else ValueError naming the key
        (a draft that reads a layer the policy lacks cannot serve on it)."""
        if bad := [i for i in taps if not 0 <= i < num_layers]:
            raise ValueError(f"draft config {key} {bad} outside the policy's layers [0, {num_layers - 1}]")
        return list(taps)

    def export_state_dict(self) -> dict[str, torch.Tensor]:
        """Weights under the exported names (no borrowed policy weights)."""
        return {name: t.detach() for name, t in self.state_dict().items()}

    # --- inference hooks used by LearnedDrafter ---
    cache_layers: int = 1  # draft layers that keep a KV cache at inference
    stops_early: bool = False  # drafts a token per forward, so a proposal can end where `stop` says

    def new_state(self, batch_size: int, max_len: int) -> DraftState:
        p = self.fusion.fc.weight
        cache = KVCache(self.layer_args, batch_size, max_len, num_layers=self.cache_layers, dtype=p.dtype,
                        device=p.device)
        rows = torch.zeros(batch_size, dtype=torch.long, device=p.device)
        return DraftState(
            cache=cache,
            absorbed=rows.clone(),
            fresh_taps=p.new_zeros(batch_size, 0, p.shape[1]),
            fresh_ids=rows.new_zeros(batch_size, 0),
            fresh_len=rows.clone(),
            holes=torch.zeros(batch_size, max_len, dtype=torch.bool, device=p.device),
        )

    def fresh_features(self, state: DraftState) -> torch.Tensor:
        """Fused features [B, U, H] of every row's fresh tokens (fusion runs here, once per absorb, not per
        verify step: while speculation is off the engine's commits only append taps)."""
        return self.fusion.project(state.fresh_taps[:, : int(state.fresh_len.max())])

    def propose(self, state: DraftState, pending: torch.Tensor, k: int, params: SamplingParams,
                stop: Callable[[torch.Tensor], bool] | None = None) -> Proposal:
        """Up to k drafts per row; a family that drafts one token per forward (`stops_early`) ends early where
        `stop` (Drafter.propose) says so, the others ignore it."""
        raise NotImplementedError


def write_cache(cache: KVCache, layer: int, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                valid: torch.Tensor | None = None) -> None:
    """Write the slots' keys/values [B, S, Hkv, D] at their positions [B, S] into the draft's cache; with
    `valid` [B, S] only those slots (padding of short rows might land past the cache's end)."""
    if valid is None:
        cache.write(layer, positions, k.transpose(1, 2), v.transpose(1, 2))
        return
    b, j = valid.nonzero(as_tuple=True)
    p = positions[b, j]
    cache.k[layer][b, :, p], cache.v[layer][b, :, p] = k[b, j], v[b, j]


def cache_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: CacheMask) -> torch.Tensor:
    """Inference attention over a draft's keys in its [B, S, H, D] layout: keys/values [B, Hkv, L, D] (cached
    and/or fresh) -> [B, S, H, D]."""
    return attend_cache(q.transpose(1, 2), keys, values, mask).transpose(1, 2)


@dataclass
class DraftState:
    """Per-row inference state of a learned draft, kept in step with the target.

    Committed tokens are those in the target's KV cache. The draft has absorbed the
    first `absorbed[b]` of them into its own `cache`; the rest wait in `fresh_*`
    (concatenated taps and ids, right-padded) until the next proposal absorbs them
    in one batched forward. Positions in `holes` were skipped (`skip_stale`): the
    draft never wrote their keys, and its attention must not see them.
    """

    cache: KVCache
    absorbed: torch.Tensor  # [B] long
    fresh_taps: torch.Tensor  # [B, U, n_taps * H]
    fresh_ids: torch.Tensor  # [B, U]
    fresh_len: torch.Tensor  # [B] long
    holes: torch.Tensor  # [B, max_len] bool, positions whose keys the draft skipped
    extra: dict[str, torch.Tensor] = field(default_factory=dict)  # family-specific per-row tensors [B, ...]
    generator: torch.Generator | None = None  # the engine's, for the draft's own sampling

    def append(self, taps: torch.Tensor, ids: torch.Tensor, counts: torch.Tensor) -> None:
        """Append the first counts[b] of taps [B, t, n_taps * H] / ids [B, t] to row b's fresh part."""
        B, t = ids.shape
        need = int((self.fresh_len + counts).max())
        if need > self.fresh_ids.shape[1]:  # grow geometrically: while speculation is off, rows append every step
            pad = max(need, 2 * self.fresh_ids.shape[1]) - self.fresh_ids.shape[1]
            self.fresh_taps = nn.functional.pad(self.fresh_taps, (0, 0, 0, pad))
            self.fresh_ids = nn.functional.pad(self.fresh_ids, (0, pad))
        steps = torch.arange(t, device=ids.device)
        keep = steps[None] < counts[:, None]
        rows = torch.arange(B, device=ids.device)[:, None].expand(B, t)[keep]
        cols = (self.fresh_len[:, None] + steps[None]).expand(B, t)[keep]
        self.fresh_taps[rows, cols] = taps[keep].to(self.fresh_taps.dtype)
        self.fresh_ids[rows, cols] = ids[keep]
        self.fresh_len += counts

    def absorb_all(self) -> None:
        """Mark every fresh token as absorbed (after the family's forward over them)."""
        self.absorbed += self.fresh_len
        self.fresh_len.zero_()

    def skip_stale(self, keep: int, prompts_from: int | None = None) -> None:
        """Drop all but the newest `keep` fresh tokens of the rows that have absorbed their prompt (and of rows
        `prompts_from` on, prompt or not): their positions become holes. While speculation is off every committed
        token waits here, and absorbing them all would cost a probe about the draft's whole per-token cost of
        the stretch; the newest few and the target's taps carry most of what the next drafts need. A prompt
        is absorbed whole except in a probe's unsampled rows: at batch 32 (~95-token chain prompts) absorbing
        all prompts took 0.23 s, two decode steps, in every generate call whose controller was off, while a
        call whose first proposal skipped its rows' prompts accepted 4-9% fewer tokens per step all along
        (batch 8, k = 2)."""
        started = self.absorbed > 0
        if prompts_from is not None:
            started |= torch.arange(started.numel(), device=started.device) >= prompts_from
        drop = torch.where(started, (self.fresh_len - keep).clamp(min=0), 0)
        if not bool(drop.any()):
            return
        positions = torch.arange(self.holes.shape[1], device=drop.device)[None]
        self.holes |= (positions >= self.absorbed[:, None]) & (positions < (self.absorbed + drop)[:, None])
        U = self.fresh_ids.shape[1]
        shifted = (drop[:, None] + torch.arange(U, device=drop.device)).clamp(max=U - 1)  # [B, U]
        self.fresh_ids = self.fresh_ids.gather(1, shifted)
        self.fresh_taps = self.fresh_taps.gather(1, shifted[..., None].expand_as(self.fresh_taps))
        self.absorbed += drop
        self.fresh_len -= drop
        self.cache.advance(drop)  # the cache's lengths count absorbed positions, holes included

    def first_rows(self, n: int) -> DraftState:
        """Rows [0, n) as views: a proposal's in-place updates to them (cache writes, absorbed counts) land here."""
        return DraftState(self.cache.first_rows(n), self.absorbed[:n], self.fresh_taps[:n], self.fresh_ids[:n],
                          self.fresh_len[:n], self.holes[:n], {name: t[:n] for name, t in self.extra.items()},
                          self.generator)

    def keep_rows(self, rows: torch.Tensor) -> None:
        self.cache.keep_rows(rows)
        self.absorbed, self.fresh_len, self.holes = self.absorbed[rows], self.fresh_len[rows], self.holes[rows]
        # the fresh taps grow by a token a step while speculation is off (32 rows x 200 x 1,728 floats: 44 MB)
        self.fresh_taps, self.fresh_ids = take_rows(self.fresh_taps, rows, 0), self.fresh_ids[rows]
        self.extra = {name: t[rows] for name, t in self.extra.items()}


class LearnedDrafter(Drafter):
    """Adapts any DraftModel to the engine's Drafter protocol."""

    def __init__(self, draft: DraftModel, max_backlog: int = 16):
        self.draft = self.model = draft
        self.max_backlog = max_backlog  # fresh tokens a proposal absorbs at most, after the prompt (skip_stale)
        self.tap_layers = draft.tap_layers
        self.state: DraftState | None = None
        self.params = SamplingParams()

    @property
    def model_dtype(self) -> torch.dtype:
        """Read at each rollout's packing, so it follows the draft's `inference_dtype` as it is then."""
        return self.draft.inference_dtype

    @torch.no_grad()
    def start(self, prompts: list[list[int]], taps: dict[int, torch.Tensor], params: SamplingParams,
              max_len: int, generator: torch.Generator | None = None) -> None:
        self.params = params
        ids, lengths = right_padded(prompts)
        self.state = self.draft.new_state(len(prompts), max_len)
        self.state.generator = generator
        concat = self.draft.concat_taps(taps)
        self.state.append(concat, ids.to(concat.device), lengths.to(concat.device))

    @property
    def stops_early(self) -> bool:
        return self.draft.stops_early

    @torch.no_grad()
    def propose(self, pending: torch.Tensor, k: int, probe_rows: int | None = None,
                stop: Callable[[torch.Tensor], bool] | None = None) -> Proposal:
        self.state.skip_stale(self.max_backlog, prompts_from=probe_rows)
        rows = pending.shape[0]
        if probe_rows is None or probe_rows >= rows:
            return self.draft.propose(self.state, pending, k, self.params, stop)
        # a probe verifies the drafts of its first rows only, so only they draft: at batch 32 a probe's absorb over
        # every row's backlog (padded to the longest, a sampled row's whole prompt) cost ~2 decode steps
        sampled = self.draft.propose(self.state.first_rows(probe_rows), pending[:probe_rows], k, self.params)
        return sampled.padded(rows)

    @torch.no_grad()
    def commit(self, tokens: torch.Tensor, kept: torch.Tensor, taps: dict[int, torch.Tensor]) -> None:
        self.state.append(self.draft.concat_taps(taps), tokens, kept)

    def keep_rows(self, rows: torch.Tensor) -> None:
        self.state.keep_rows(rows)
