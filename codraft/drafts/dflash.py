"""DFlash: a block-diffusion draft that proposes b-1 tokens in one forward.

Architecture (z-lab/dflash `DFlashDraftModel`): the policy's taps at a few layers
(spread evenly from layer 1 to L-3, one per draft layer) are concatenated and
fused by `fc` + RMSNorm into the context feature c_t of every committed position t.
`num_layers` non-causal Qwen3-style layers then run over a block
[anchor token, MASK * (b-1)] at positions a..a+b-1, embedded with the policy's
(borrowed, frozen) embedding. In every layer the keys/values are
[k_proj(c_t) for t < a ; k_proj(block)] — the context is projected by the SAME
k_proj/v_proj (and k_norm, rotary at its own position) as the block, with no input
norm (the fused feature is already normalised), exactly as `Qwen3DFlashAttention`
does (`k_ctx = self.k_proj(target_hidden)`); queries come from the block only. A
final norm and the policy's (borrowed, frozen) lm_head give the logits of slot k,
the draft of token a+k. Draft layers always use q/k norms (Qwen3), whatever the policy.

Training maps each block onto branch attention (codraft.attention): main K/V are the
context K/V of every packed position, one branch group per sampled anchor with the
b block queries and b block keys (all visible: bidirectional), exclusive anchor.
Only branch outputs are computed (q=None). Slot k predicts token a+k against the
policy's distribution at a+k-1, weighted exp(-(k-1)/gamma) and by loss_mask[a+k].

Inference keeps the context K/V of the committed tokens in a per-layer KVCache
(written at their positions when fresh tokens are absorbed) and runs one forward
over [pending, MASK...] at positions n..n+b-1 (n = committed tokens of the row);
block K/V take part in that forward only and are never written to the cache.
Slots are conditionally independent given the context, so each slot's token is
drawn from its own distribution, which is the q reported for verification. With a
reduced draft vocabulary (`draft.draft_vocab_size` < V) inference scores only the
policy head's rows for it (vocab.py); training always uses the whole vocabulary.

Export (config.json; weights carry no embedding or lm_head, they are the policy's):

    config key                       meaning
    architectures                    ["DFlashDraftModel"] (DSpark: ["DSparkDraftModel"])
    codraft_family                   "dflash" | "dspark"
    model_type                       "qwen3" (the layer type)
    num_hidden_layers                draft layers
    block_size                       b (also dflash_config.block_size)
    dflash_config.target_layer_ids   policy layers tapped, in fusion order
    dflash_config.mask_token_id      id embedded in the MASK slots
    num_target_layers                policy layers
    hidden_size, vocab_size          the policy's (the draft reads its taps, embedding and head)
    intermediate_size, num_attention_heads, num_key_value_heads, head_dim, rms_norm_eps,
    rope_theta, rope_scaling         the draft layers' (by default the policy's)
    max_position_embeddings, tie_word_embeddings, torch_dtype
    attention_bias                   false (q/k norms are always on, as in Qwen3)
    markov_rank, confidence_head     DSpark only

    weight                                        shape
    fc.weight                                     [H, n_taps * H]
    hidden_norm.weight                            [H]
    layers.{i}.input_layernorm.weight             [H]
    layers.{i}.self_attn.{q,k,v,o}_proj.weight    as the policy's attention
    layers.{i}.self_attn.{q,k}_norm.weight        [head_dim]
    layers.{i}.post_attention_layernorm.weight    [H]
    layers.{i}.mlp.{gate,up,down}_proj.weight     as the policy's MLP
    norm.weight                                   [H]
    markov.w1.weight, markov.w2.weight            [V, r] each (DSpark)
    head_vocab                                    [N] int64, ascending target ids drafted at inference
                                                  (codraft's; absent: the whole vocabulary)
    confidence.weight, confidence.bias            [1, H], [1] (DSpark with confidence head)
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import replace

import torch
from torch import nn

from codraft.attention import Branches
from codraft.config import DraftConfig
from codraft.drafts.anchors import pad_anchors, sample_anchors
from codraft.drafts.base import (
    DraftBatch,
    DraftModel,
    DraftState,
    cache_attention,
    write_cache,
)
from codraft.drafts.export import draft_config, exported_layer_args, load_checked, register_family
from codraft.drafts.layers import DraftLayer
from codraft.drafts.losses import draft_loss, expected_acceptance, weighted_mean
from codraft.drafts.vocab import HeadRows, draft_vocab, vocab_ids
from codraft.models import ModelArgs
from codraft.models.cache_attention import cache_mask
from codraft.models.model import RMSNorm
from codraft.models.rope import RotaryEmbedding
from codraft.rollout.drafter import Proposal
from codraft.rollout.sampling import SamplingParams, draw_proposal

# (layer index, q [.., b, H, D], k/v [.., b, Hkv, D] of the block) -> attention output [.., b, H, D]
Attend = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]

# internal parameter prefix -> exported name (z-lab/dflash layout)
EXPORT_NAMES = {"fusion.fc.": "fc.", "fusion.norm.": "hidden_norm."}


def default_tap_layers(num_policy_layers: int, num_draft_layers: int) -> list[int]:
    """DFlash's placement: evenly from layer 1 to L-3, one per draft layer (L//2 for one), deduplicated
    for policies too shallow to give each draft layer its own."""
    L = num_policy_layers
    if num_draft_layers == 1:
        return [L // 2]
    start = min(1, L - 1)
    end = max(L - 3, start)
    spread = [round(start + i * (end - start) / (num_draft_layers - 1)) for i in range(num_draft_layers)]
    return list(dict.fromkeys(spread))


def pick_mask_token(tokenizer_vocab_size: int, model_vocab_size: int, special_ids: Iterable[int] = ()) -> int:
    """A token id for the MASK slots when the config names none.

    Only its (frozen, borrowed) embedding matters, so it should be an id that real text
    never or rarely uses, in this order of preference:
      1. `tokenizer_vocab_size` when the model's vocab is padded past the tokenizer's: a row
         the tokenizer never produces (z-lab's `<|MASK|>` sits in Qwen3's padding too);
      2. the largest of `special_ids`: control tokens the caller knows to be unused in
         rollouts (reserved or tool tokens; not BOS/EOS or chat markers);
      3. the model's last id: byte-level BPE orders merges by frequency, so it is the rarest.
    """
    if tokenizer_vocab_size < model_vocab_size:
        return tokenizer_vocab_size
    special = [i for i in special_ids if 0 <= i < model_vocab_size]
    return max(special) if special else model_vocab_size - 1


class BlockLayer(DraftLayer):
    """A Qwen3 decoder layer whose attention the draft runs: input norm + DraftLayer."""

    def __init__(self, args: ModelArgs):
        super().__init__(args, args.hidden_size, context_kv=True)
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)


class DFlashDraft(DraftModel):
    family = "dflash"
    architecture = "DFlashDraftModel"

    def __init__(
        self,
        cfg: DraftConfig,
        policy_args: ModelArgs,
        *,
        layer_args: ModelArgs | None = None,
        tokenizer_vocab_size: int | None = None,
        special_ids: Iterable[int] = (),
        token_counts: torch.Tensor | None = None,
    ):
        """layer_args: shapes of the draft layers (default: the policy's, with q/k norms, no bias); an exported
        draft may differ in heads and MLP width, not in hidden size. Without `cfg.mask_token_id` the MASK id is
        `pick_mask_token(tokenizer_vocab_size, vocab, special_ids)`. `token_counts` [V] pick the drafted tokens
        when `cfg.draft_vocab_size` < V (vocab.py)."""
        super().__init__(cfg, policy_args, default_tap_layers(policy_args.num_layers, cfg.num_layers), fusion_norm=True)
        V = policy_args.vocab_size
        mask = cfg.mask_token_id
        if mask is None:
            mask = pick_mask_token(tokenizer_vocab_size or V, V, special_ids)
        assert 0 <= mask < V, (mask, V)  # a configured id was checked against the vocab by cfg.validate
        self.mask_token_id = mask
        self.block_size = cfg.block_size
        self.layer_args = layer_args or replace(policy_args, qk_norm=True, attention_bias=False)
        self.layers = nn.ModuleList(BlockLayer(self.layer_args) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(policy_args.hidden_size, self.layer_args.rms_norm_eps)
        self.rotary = RotaryEmbedding(self.layer_args)
        if 0 < cfg.draft_vocab_size < V:
            d2t, _ = draft_vocab(token_counts, V, cfg.draft_vocab_size)
            self.register_buffer("head_vocab", vocab_ids(d2t))
        else:
            self.head_vocab: torch.Tensor | None = None
        self.rows = {"head": HeadRows()}  # inference heads over head_vocab (DSpark adds its Markov bias)

    # --- the block forward, shared by training and inference ---
    def block_ids(self, first: torch.Tensor) -> torch.Tensor:
        """first [G] -> [G, b]: the anchor token, then MASK."""
        ids = first.new_full((first.numel(), self.block_size), self.mask_token_id)
        ids[:, 0] = first
        return ids

    def run_block(self, first: torch.Tensor, positions: torch.Tensor, attend: Attend) -> torch.Tensor:
        """Blocks [first, MASK...] at positions [G, b] -> final-normed hidden [G, b, H]."""
        x = self.embed(self.block_ids(first))
        cos, sin = self.rotary(positions, x.dtype)
        for i, layer in enumerate(self.layers):
            h = layer.input_layernorm(x)
            q, k, v = layer.self_attn.qkv(h, cos, sin)
            x = layer.finish(attend(i, q, k, v), x)
        return self.norm(x)

    def context_kv(self, i: int, context: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer i's keys/values of context features [..., S, H] at positions [..., S] -> [..., S, Hkv, D]."""
        cos, sin = self.rotary(positions, context.dtype)
        return self.layers[i].self_attn.kv(context, cos, sin)

    # --- hooks DSpark overrides ---
    def slot_logits(self, hidden: torch.Tensor, prev_tokens: torch.Tensor) -> torch.Tensor:
        """Training: hidden [..., H] of slots, prev_tokens [...] the token before each slot -> logits [..., V]
        over the whole vocabulary (inference drafts over `head_vocab`: head_logits). DFlash slots do not depend
        on the previous token."""
        return self.policy_head(hidden)

    def draft_block(
        self, hidden: torch.Tensor, first: torch.Tensor, params: SamplingParams, generator: torch.Generator | None
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """hidden [B, n, H] of slots 1..n, first [B] the anchor -> tokens [B, n] (target ids), their draft probs
        [B, n, N] over the draft vocabulary (None when greedy) and the draft's confidence in each [B, n].
        Independent slots: all drawn at once, each from its own distribution."""
        local, probs, confidence = draw_proposal(self.head_logits(hidden), params, generator)
        return self.target_ids(local), probs, confidence

    # --- the inference head over the draft vocabulary ---
    def head_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Inference: the policy head's logits [..., N] over `head_vocab` (all V without one)."""
        if self.head_vocab is None:
            return self.policy_head(hidden)
        assert self._head is not None, "call draft.attach(policy) first"
        return self.rows["head"](self._head, self.head_vocab, self.inference_dtype)(hidden)

    def target_ids(self, local: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary indices -> target ids."""
        return local if self.head_vocab is None else self.head_vocab[local]

    def block_loss(
        self,
        hidden: torch.Tensor,  # [G, b-1, H] slots 1..b-1
        logits: torch.Tensor,  # [G, b-1, V]
        policy_logits: torch.Tensor,  # [G, b-1, V]
        targets: torch.Tensor,  # [G, b-1] rollout tokens
        weights: torch.Tensor,  # [G, b-1]
        total: Callable[[torch.Tensor], torch.Tensor],  # sum over the ranks (TokenShard.total)
    ) -> tuple[torch.Tensor, dict[str, float]]:
        per_slot = draft_loss(logits.flatten(0, 1), policy_logits.flatten(0, 1), targets.flatten(), self.cfg.loss)
        return weighted_mean(per_slot, weights.flatten(), total), {}

    # --- training ---
    def block_hidden(
        self,
        context: torch.Tensor,
        cu_seqlens: torch.Tensor,
        positions: torch.Tensor,
        anchors: torch.Tensor,
        first: torch.Tensor,
    ) -> torch.Tensor:
        """Blocks [first, MASK...] at anchors [G] of the packed context features [T, H] (rotary positions [T])
        -> hidden [G, b, H]. Each block sees the context of its sequence strictly before its anchor."""

        def attend(i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            k_ctx, v_ctx = self.context_kv(i, context, positions)  # [T, Hkv, D]
            blocks = Branches(q, k, v, anchors, inclusive=False)
            return self.attention(None, k_ctx, v_ctx, cu_seqlens, blocks).branch_out

        block_pos = positions[anchors][:, None] + torch.arange(self.block_size, device=anchors.device)  # [G, b]
        return self.run_block(first, block_pos, attend)

    def loss(
        self,
        batch: DraftBatch,
        *,
        anchors: torch.Tensor | None = None,
        generator: torch.Generator | None = None,
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """Block loss over `anchors` [G] (global packed positions), by default sampled with `generator`
        over the whole batch; this rank computes the blocks whose anchor it owns (`batch.shard`), and
        reads their targets by global index."""
        tokens, b = batch.shard, self.block_size
        ids = tokens.input_ids  # [T] the whole batch
        if anchors is None:
            anchors = sample_anchors(tokens.loss_mask, tokens.cu_seqlens, b, self.cfg.num_anchors, generator)
        anchors, real = pad_anchors(anchors, self.cfg.num_anchors)  # a few block counts recur (anchors.py)
        owned, local = tokens.own(anchors)
        anchors, real = anchors[owned], real[owned]  # [G_r] global, the blocks of this rank
        context = self.fuse(batch.taps)  # [T_local, H]
        hidden = self.block_hidden(context, batch.cu_seqlens, batch.rope_positions(), local, ids[anchors])
        hidden = hidden[:, 1:]  # [G, b-1, H] slots 1..b-1
        slots = torch.arange(1, b, device=anchors.device)
        target_at = anchors[:, None] + slots  # [G, b-1] global packed position of the token slot k drafts
        targets = ids[target_at]
        policy_logits = tokens.rows(batch.policy_logits, target_at - 1)
        weights = torch.exp(-(slots - 1) / self.cfg.gamma) * tokens.loss_mask[target_at] * real[:, None]
        logits = self.slot_logits(hidden, ids[target_at - 1])  # teacher forcing for DSpark
        loss, metrics = self.block_loss(hidden, logits, policy_logits, targets, weights, tokens.total)
        metrics.update(self.block_metrics(logits, policy_logits, targets, weights, tokens.total))
        metrics["draft/anchors"] = float(tokens.total(real.sum()))
        return loss, {"loss/draft": loss.item(), **metrics}

    @torch.no_grad()
    def block_metrics(
        self,
        logits: torch.Tensor,
        policy_logits: torch.Tensor,
        targets: torch.Tensor,
        weights: torch.Tensor,
        total: Callable[[torch.Tensor], torch.Tensor],
    ) -> dict[str, float]:
        valid = weights > 0  # [G, b-1]
        n = total(valid.sum()).clamp(min=1)
        correct = (logits.argmax(-1) == targets) & valid
        accept = expected_acceptance(logits.flatten(0, 1), policy_logits.flatten(0, 1)).view_as(weights)
        metrics = {
            "draft/acc": (total(correct.sum()) / n).item(),
            "draft/expected_accept": (total((accept * valid).sum()) / n).item(),
        }
        per_slot = total(correct.sum(0)) / total(valid.sum(0)).clamp(min=1)
        metrics.update({f"draft/acc_pos_{k}": acc for k, acc in enumerate(per_slot.tolist())})  # slot k + 1
        return metrics

    # --- inference ---
    @property
    def cache_layers(self) -> int:
        return len(self.layers)

    def absorb(self, state: DraftState) -> None:
        """Write every layer's context K/V of the fresh tokens at their positions, only the valid ones."""
        U = int(state.fresh_len.max())
        if U:
            steps = torch.arange(U, device=state.absorbed.device)
            positions = state.absorbed[:, None] + steps  # [B, U]
            valid = steps[None] < state.fresh_len[:, None]
            context = self.fresh_features(state)  # [B, U, H]
            for i in range(len(self.layers)):
                write_cache(state.cache, i, positions, *self.context_kv(i, context, positions), valid)
        state.absorb_all()
        state.cache.lengths.copy_(state.absorbed)

    def propose(self, state: DraftState, pending: torch.Tensor, k: int, params: SamplingParams,
                stop: Callable[[torch.Tensor], bool] | None = None) -> Proposal:
        """One block forward per row -> min(k, b-1) drafts per row (all at once: `stop` does not apply)."""
        self.absorb(state)
        n = state.absorbed  # [B] committed tokens; the block starts at position n
        B, L, b = n.numel(), int(n.max()), self.block_size
        context_visible = (torch.arange(L, device=n.device)[None] < n[:, None]) & ~state.holes[:, :L]  # [B, L]
        visible = torch.cat([context_visible, n.new_ones(B, b, dtype=torch.bool)], 1)  # [B, L + b]
        mask = cache_mask(visible[:, None], b, self.layer_args, state.cache.k.dtype)

        def attend(i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            keys = torch.cat([state.cache.k[i, :, :, :L], k.transpose(1, 2)], dim=2)  # [B, Hkv, L + b, D]
            values = torch.cat([state.cache.v[i, :, :, :L], v.transpose(1, 2)], dim=2)
            return cache_attention(q, keys, values, mask)

        positions = n[:, None] + torch.arange(b, device=n.device)
        width = min(k, b - 1)
        hidden = self.run_block(pending, positions, attend)[:, 1 : 1 + width]
        tokens, probs, confidence = self.draft_block(hidden, pending, params, state.generator)
        lengths = torch.full((B,), width, dtype=torch.long, device=n.device)
        return Proposal(tokens, lengths, probs, vocab=None if probs is None else self.head_vocab, confidence=confidence)

    # --- export ---
    def export_config(self) -> dict:
        p = self.policy_args
        return {
            "architectures": [self.architecture],
            "codraft_family": self.family,
            "model_type": "qwen3",
            "num_hidden_layers": len(self.layers),
            "block_size": self.block_size,
            "dflash_config": {
                "target_layer_ids": list(self.tap_layers),
                "mask_token_id": self.mask_token_id,
                "block_size": self.block_size,
            },
            "num_target_layers": p.num_layers,
            **self.layer_export_config(),
            "tie_word_embeddings": p.tie_word_embeddings,
        }

    def export_state_dict(self) -> dict[str, torch.Tensor]:
        return {_rename(name, EXPORT_NAMES): t.detach() for name, t in self.state_dict().items()}

    @classmethod
    def config_from_export(cls, config: dict) -> DraftConfig:
        """The DraftConfig of an exported draft: codraft's saved one, overridden by the layout's own keys
        (z-lab's configs keep them in `dflash_config`, some also `block_size` at the top)."""
        dflash = config["dflash_config"]
        return replace(
            draft_config(config),
            family=cls.family,
            num_layers=config["num_hidden_layers"],
            block_size=dflash.get("block_size", config.get("block_size")),
            tap_layers=list(dflash["target_layer_ids"]),
            mask_token_id=dflash.get("mask_token_id"),
        )

    @classmethod
    def from_export(cls, config: dict, state: dict[str, torch.Tensor], policy_args: ModelArgs) -> DFlashDraft:
        """Rebuild an exported draft for `policy_args` (call `attach(policy)` before use)."""
        cls.check_policy_fit(config, {"num_target_layers": policy_args.num_layers,
                                      "hidden_size": policy_args.hidden_size,
                                      "vocab_size": policy_args.vocab_size}, required=False)
        layer_args = exported_layer_args(replace(policy_args, qk_norm=True, attention_bias=False), config)
        vocab = state.get("head_vocab")  # z-lab's exports and codraft's older ones draft the whole vocabulary
        cfg = replace(cls.config_from_export(config), draft_vocab_size=0 if vocab is None else vocab.numel())
        cls.check_taps_fit(cfg.tap_layers, "dflash_config.target_layer_ids", policy_args.num_layers)
        draft = cls(cfg, policy_args, layer_args=layer_args)
        back = {new: old for old, new in EXPORT_NAMES.items()}
        load_checked(draft, {_rename(name, back): t for name, t in state.items()})
        return draft


def _rename(name: str, prefixes: dict[str, str]) -> str:
    for old, new in prefixes.items():
        if name.startswith(old):
            return new + name[len(old) :]
    return name


register_family(DFlashDraft.family, DFlashDraft, (DFlashDraft.architecture,))
