"""EAGLE-3: one decoder layer over fused policy taps, trained with Training-Time Test.

Position t reads the fused feature f_t and the embedding of token x_{t+1} and
predicts x_{t+2}; the layer's pre-norm output h_t feeds the next draft step as
its hidden input. TTT unrolls `ttt_steps` such steps at training time on
branch attention (DESIGN.md, "How each draft family maps onto branch attention"):

    step 0       main queries, plain causal attention per packed sequence;
                 its keys K0/V0 are the main keys of every later step.
    step s >= 1  input (h_t of step s-1, x_{t+1+s}) at rotary position t+s; one
                 branch per position t: Branches(q [T, 1, H, D], k/v of steps
                 1..s at t [T, s, Hkv, D], anchors = arange(T), inclusive), so
                 the query sees K0 at positions <= t plus its own chain keys.

At inference the draft keeps a one-layer KV cache in step with the target: the
committed pairs (f_j, x_{j+1}) are absorbed in one ragged forward, then the chain
writes tentative keys past the committed length, which the next absorb
overwrites. That is exactly the attention pattern of TTT step s at t = n-1.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from codraft.attention import Branches
from codraft.config import DraftConfig
from codraft.drafts.base import DraftBatch, DraftModel, DraftState, cache_attention, write_cache
from codraft.drafts.export import draft_config, exported_layer_args, load_checked, register_family
from codraft.drafts.layers import DraftLayer
from codraft.drafts.losses import draft_loss, expected_acceptance, weighted_mean
from codraft.drafts.vocab import draft_vocab, vocab_ids
from codraft.models import ModelArgs
from codraft.models.cache_attention import cache_mask
from codraft.models.linear import Linear
from codraft.models.model import RMSNorm
from codraft.models.rope import RotaryEmbedding
from codraft.rollout.drafter import Proposal
from codraft.rollout.sampling import SamplingParams, draw_proposal

ARCHITECTURE = "LlamaForCausalLMEagle3"


def default_tap_layers(num_layers: int) -> list[int]:
    """Outputs of layers 1, L//2-1, L-4 (0-indexed): always three layers when the policy has at least three
    (SpecForge, SGLang and vLLM build EAGLE-3's fc for exactly 3 taps). Below 7 layers those collide or fall
    outside the model, so the taps are low, middle and last instead: min(1, L-3), their midpoint, L-1.
    A policy of one or two layers gives each of its layers."""
    L = num_layers
    if L < 3:
        return list(range(L))
    if L < 7:
        low, high = min(1, L - 3), L - 1
        return [low, (low + high) // 2, high]
    return [1, L // 2 - 1, L - 4]


def draft_layer_args(policy_args: ModelArgs) -> ModelArgs:
    """The draft layer is a plain Llama layer of the policy's width (what SGLang/vLLM build for it)."""
    return replace(policy_args, num_layers=1, qk_norm=False, attention_bias=False)


class Eagle3Layer(DraftLayer):
    """Attention reads concat(input_layernorm(embedding), hidden_norm(hidden)) [.., 2H]; residual is the hidden."""

    def __init__(self, args: ModelArgs):
        super().__init__(args, attn_in_features=2 * args.hidden_size)
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.hidden_norm = RMSNorm(args.hidden_size, args.rms_norm_eps)

    def attn_input(self, embeds: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.input_layernorm(embeds.to(hidden.dtype)), self.hidden_norm(hidden)], dim=-1)


class Eagle3Draft(DraftModel):
    """EAGLE-3 draft. `token_counts` [policy vocab] picks the draft vocabulary (see vocab.py);
    `layer_args` overrides the draft layer's shapes (a loaded checkpoint may differ from the policy's)."""

    family = "eagle3"
    reads_whole_vocabulary = False  # its draft vocabulary's columns and a flag (`policy_rows`)
    stops_early = True

    def __init__(
        self,
        cfg: DraftConfig,
        policy_args: ModelArgs,
        *,
        token_counts: torch.Tensor | None = None,
        layer_args: ModelArgs | None = None,
    ):
        super().__init__(cfg, policy_args, default_tap_layers(policy_args.num_layers), fusion_norm=False)
        V, H = policy_args.vocab_size, policy_args.hidden_size
        self.layer_args = layer_args or draft_layer_args(policy_args)
        assert self.layer_args.hidden_size == H, "the draft layer works in the policy's hidden size"
        self.midlayer = Eagle3Layer(self.layer_args)
        self.norm = RMSNorm(H, self.layer_args.rms_norm_eps)
        d2t, t2d = draft_vocab(token_counts, V, cfg.draft_vocab_size)
        self.register_buffer("d2t", d2t)  # [N] int64: draft id i is target id i + d2t[i]
        self.register_buffer("t2d", t2d)  # [V] bool: target id is in the draft vocab
        self.lm_head = Linear(H, d2t.numel(), bias=False)
        self.rotary = RotaryEmbedding(self.layer_args)

    # --- the layer, shared by training and inference ---
    def draft_ids(self) -> torch.Tensor:
        """[N] target id of each draft id."""
        return vocab_ids(self.d2t)

    @torch.no_grad()
    def copy_policy_head(self, policy: nn.Module) -> None:
        """Start the final norm and the head as the policy's (the head's rows of the draft vocabulary), so the
        draft only has to learn to produce the policy's last hidden state, not a decoder of its own."""
        self.lm_head.weight.copy_(policy.lm_head.weight[self.draft_ids()])
        self.norm.weight.copy_(policy.norm.weight)

    @torch.no_grad()
    def copy_policy_layer(self, policy: nn.Module, index: int) -> None:
        """Start the layer as policy layer `index` reading the highest tap: fc passes that tap through, the
        attention's hidden half and hidden_norm, o_proj, the MLP and its norm are the policy layer's, the
        embedding's half of q/k/v is zero (the gradient still reaches it). With `index` = highest tap + 1, step 0
        then outputs the policy's residual stream after that layer."""
        if self.policy_args.qk_norm or self.policy_args.attention_bias:
            raise ValueError(f"draft.layer_from_policy={index}: the policy's layers have q/k norms or attention "
                             "biases, which EAGLE-3's layer has not; leave it unset")
        if str(index) not in policy.layers:
            raise ValueError(f"draft.layer_from_policy={index}: this policy holds layers "
                             f"{', '.join(policy.layers) or 'none'} (under pipeline parallelism the draft's stage "
                             "must hold the layer)")
        src, dst, H = policy.layers[str(index)], self.midlayer, self.policy_args.hidden_size
        fc = self.fusion.fc.weight
        fc.zero_()
        fc[:, -H:] = torch.eye(H, dtype=fc.dtype, device=fc.device)
        dst.hidden_norm.weight.copy_(src.input_layernorm.weight)
        for name in ("q_proj", "k_proj", "v_proj"):
            weight = getattr(dst.self_attn, name).weight
            weight[:, :H] = 0.0
            weight[:, H:] = getattr(src.self_attn, name).weight
        dst.self_attn.o_proj.weight.copy_(src.self_attn.o_proj.weight)
        dst.post_attention_layernorm.weight.copy_(src.post_attention_layernorm.weight)
        dst.mlp.load_state_dict(src.mlp.state_dict())

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """Pre-norm layer output [.., H] -> draft-vocab logits [.., N]."""
        return self.lm_head(self.norm(hidden))

    def _qkv(self, hidden: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor):
        """hidden [.., S, H], tokens/positions [.., S] -> q [.., S, H, D], k/v [.., S, Hkv, D]."""
        x = self.midlayer.attn_input(self.embed(tokens), hidden)
        cos, sin = self.rotary(positions, x.dtype)
        return self.midlayer.self_attn.qkv(x, cos, sin)

    # --- training ---
    def ttt_forward(
        self,
        feats: torch.Tensor,
        ids: torch.Tensor,
        cu_seqlens: torch.Tensor,
        positions: torch.Tensor,
        steps: int,
        index: torch.Tensor | None = None,
        rows: torch.Tensor | None = None,
    ) -> list[torch.Tensor]:
        """Draft-vocab logits [T, N] of TTT steps 0..steps-1 over packed feats [T, H]; with `rows` [R] only
        those rows' chains [R, N]. Step 0's keys come from every row, but a chain only ever reads its own
        row's past steps and step 0's keys, so the rows that feed no loss (prompt rows) stop after their keys:
        the layer's projections, MLP and head then run on R rows, not T.

        `ids` [T_all] are the token ids of the whole packed batch and `index` [T] the place of each of
        the T computed tokens in it (default: they are the whole batch), since step s at token t reads
        ids[t+1+s], which under CP may belong to another rank's tokens. Clamped at the batch's end:
        what crosses a sequence end is junk that the loss masks; it never leaks into other positions,
        since a branch sees only its own chain keys besides K0.
        """
        T_all, T = ids.numel(), feats.shape[0]
        index = torch.arange(T, device=ids.device) if index is None else index
        rows = torch.arange(T, device=ids.device) if rows is None else rows
        q, k0, v0 = self._qkv(feats, ids[(index + 1).clamp(max=T_all - 1)], positions)
        out = self.attention(q, k0, v0, cu_seqlens).out
        hidden = self.midlayer.finish(out[rows], feats[rows])  # [R, H], the next step's hidden input
        logits = [self.head(hidden)]
        index, positions = index[rows], positions[rows]
        chain_k: list[torch.Tensor] = []
        chain_v: list[torch.Tensor] = []
        for s in range(1, steps):
            q, k, v = self._qkv(hidden, ids[(index + 1 + s).clamp(max=T_all - 1)], positions + s)
            chain_k.append(k)
            chain_v.append(v)
            branches = Branches(q[:, None], torch.stack(chain_k, 1), torch.stack(chain_v, 1), rows, True)
            out = self.attention(None, k0, v0, cu_seqlens, branches).branch_out[:, 0]
            hidden = self.midlayer.finish(out, hidden)
            logits.append(self.head(hidden))
        return logits

    def loss(self, batch: DraftBatch) -> tuple[torch.Tensor, dict[str, float]]:
        """Sum over TTT steps s of ttt_decay**s * mean loss over the positions whose target x_{t+2+s}
        is a response token of the same sequence and whose policy argmax is in the draft vocab.
        Look-ahead (tokens, mask, policy rows) is read by global index through `batch.shard`."""
        tokens, kind = batch.shard, self.cfg.loss
        ids, T, index = tokens.input_ids, tokens.num_tokens, tokens.index  # whole batch; index [T_local]
        taps = {layer: t.detach() for layer, t in batch.taps.items()}  # the policy never gets draft gradient
        seq_end = tokens.seq_end(index)  # [T_local] end of each token's sequence
        target = index + 2  # global index of the token step 0 predicts
        targets = [(target + s).clamp(max=T - 1) for s in range(self.cfg.ttt_steps)]
        in_response = [(target + s < seq_end) & tokens.loss_mask[tgt] for s, tgt in enumerate(targets)]
        scored = torch.stack(in_response).any(0).nonzero().flatten()  # [R] local rows some step's loss reads
        logits = self.ttt_forward(self.fuse(taps), ids, batch.cu_seqlens, batch.rope_positions(), self.cfg.ttt_steps,
                                  index, rows=scored)

        policy_logits = batch.policy_logits.detach()
        # one look-ahead per step for the policy's draft-vocab logits and whether its top token is draftable
        policy_and_vocab = policy_logits if batch.policy_reduced else self.policy_rows(policy_logits)  # [T_local, N+1]
        to_draft = self.t2d.long().cumsum(0) - 1  # [V] target id -> draft id (where t2d)

        total = logits[0].new_zeros((), dtype=torch.float32)
        stats: dict[str, torch.Tensor] = {}
        for s, step_logits in enumerate(logits):
            tgt = targets[s]
            ahead = tokens.rows(policy_and_vocab, tgt - 1)[scored]  # policy row tgt - 1 predicts token tgt
            tgt = tgt[scored]
            policy = ahead[:, :-1]  # [R, N]
            valid = in_response[s][scored] & (ahead[:, -1] > 0)
            if kind == "hard_ce":
                valid &= self.t2d[ids[tgt]]
            weight = valid.float()
            mean = partial(weighted_mean, weights=weight, total=tokens.total, weight_sum=tokens.total(weight.sum()))
            per_position = draft_loss(step_logits, policy, to_draft[ids[tgt]].clamp(min=0), kind)
            step_loss = mean(per_position)
            total = total + self.cfg.ttt_decay**s * step_loss
            with torch.no_grad():
                agree = (step_logits.argmax(-1) == policy.argmax(-1)).float()
                stats[f"draft/loss_pos_{s}"] = step_loss.detach()
                stats[f"draft/acc_pos_{s}"] = mean(agree)
                stats[f"draft/expected_accept_pos_{s}"] = mean(expected_acceptance(step_logits, policy))
        stats["loss/draft"] = total.detach()
        values = torch.stack(list(stats.values())).tolist()  # one device sync for all metrics
        return total, dict(zip(stats, values, strict=True))

    def policy_rows(self, logits: torch.Tensor) -> torch.Tensor:
        """[..., V] -> [..., N + 1]: the draft vocabulary's columns (the loss's softmax renormalises them), then 1 where
        the row's top token is in the draft vocabulary, else 0 (a row whose top token is not is not scored)."""
        in_vocab = self.t2d[logits.argmax(-1)]
        return torch.cat([logits.index_select(-1, self.draft_ids()), in_vocab[..., None].to(logits.dtype)], -1)

    # --- inference ---
    @torch.no_grad()
    def propose(self, state: DraftState, pending: torch.Tensor, k: int, params: SamplingParams,
                stop: Callable[[torch.Tensor], bool] | None = None) -> Proposal:
        """Absorb the fresh committed tokens, then draft a chain of up to k tokens per row, ending after the i-th
        where `stop` says so of the confidences so far (the forward for the next is not run).

        Greedy rows need no distribution (the draft's argmax is a point mass); sampled ones report theirs
        over the draft vocabulary only (`Proposal.vocab`), the rest of the target vocab having q = 0.
        """
        hidden = self._absorb(state, pending)  # [B, H] output at the last committed position n-1
        last = state.absorbed - 1  # [B]
        vocab = self.draft_ids()
        tokens, probs, confidence = [], [], []
        for i in range(k):
            local, p, c = draw_proposal(self.head(hidden), params, state.generator)  # [B] draft ids, [B, N] | None
            tokens.append(vocab[local])
            probs.append(p)
            confidence.append(c)
            if i + 1 == k or (stop is not None and stop(torch.stack(confidence, 1))):
                break
            pos = (last + i + 1)[:, None]  # tentative keys at n-1+i+1, past the committed length
            hidden = self._cached_forward(state, hidden[:, None], tokens[-1][:, None], pos, None)[:, 0]
        B = pending.shape[0]
        lengths = torch.full((B,), len(tokens), dtype=torch.long, device=pending.device)
        sampled = not params.greedy
        return Proposal(torch.stack(tokens, 1), lengths, torch.stack(probs, 1) if sampled else None,
                        vocab=vocab if sampled else None, confidence=torch.stack(confidence, 1))

    def _absorb(self, state: DraftState, pending: torch.Tensor) -> torch.Tensor:
        """One ragged forward over the pairs (f_j, x_{j+1}) of every row's fresh tokens -> hidden [B, H]
        at each row's last one; the cache then holds exactly the committed tokens."""
        assert bool((state.fresh_len > 0).all()), "every row commits at least one token between proposals"
        B, U = pending.shape[0], int(state.fresh_len.max())
        steps = torch.arange(U, device=pending.device)
        valid = steps[None] < state.fresh_len[:, None]  # [B, U]
        is_last = steps[None] == state.fresh_len[:, None] - 1
        nxt = F.pad(state.fresh_ids[:, 1:U], (0, 1))  # the next committed id ...
        nxt = torch.where(is_last, pending[:, None], nxt)  # ... or the pending token after the last one
        positions = torch.where(valid, state.absorbed[:, None] + steps, 0)
        hidden = self._cached_forward(state, self.fresh_features(state), nxt, positions, valid)
        out = hidden[torch.arange(B, device=pending.device), state.fresh_len - 1]
        state.cache.advance(state.fresh_len)
        state.absorb_all()
        return out

    def _cached_forward(
        self,
        state: DraftState,
        hidden: torch.Tensor,  # [B, S, H]
        tokens: torch.Tensor,  # [B, S]
        positions: torch.Tensor,  # [B, S]
        valid: torch.Tensor | None,  # [B, S] bool, slots to write to the cache; None = all
    ) -> torch.Tensor:
        """Write the slots' keys at their positions, attend to cached keys at positions <= own (holes
        excepted) -> [B, S, H]."""
        cache = state.cache
        q, k, v = self._qkv(hidden, tokens, positions)
        write_cache(cache, 0, positions, k, v, valid)
        kv_len = int(positions.max()) + 1
        visible = torch.arange(kv_len, device=positions.device) <= positions[..., None]  # [B, S, kv_len]
        visible &= ~state.holes[:, None, :kv_len]
        mask = cache_mask(visible, q.shape[1], self.layer_args, cache.k.dtype)
        out = cache_attention(q, cache.k[0, :, :, :kv_len], cache.v[0, :, :, :kv_len], mask)
        return self.midlayer.finish(out, hidden)

    # --- export (SGLang / vLLM `LlamaForCausalLMEagle3` layout) ---
    def export_config(self) -> dict:
        return {
            "architectures": [ARCHITECTURE],
            "model_type": "llama",
            **self.layer_export_config(),
            "target_hidden_size": self.policy_args.hidden_size,
            "num_hidden_layers": 1,
            "hidden_act": "silu",
            "draft_vocab_size": self.d2t.numel(),
            "tie_word_embeddings": False,
            # SGLang reads eagle_config's ids as layer OUTPUTS (it captures the input of layer id+1);
            # vLLM reads the top-level ids as layer INPUTS. Both keys describe the same taps.
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(self.tap_layers), "use_aux_hidden_state": True},
            "eagle_aux_hidden_state_layer_ids": [i + 1 for i in self.tap_layers],
        }

    def export_state_dict(self) -> dict[str, torch.Tensor]:
        return {name.removeprefix("fusion."): t.detach() for name, t in self.state_dict().items()}

    @classmethod
    def from_export(cls, config: dict, state: dict[str, torch.Tensor], policy_args: ModelArgs) -> Eagle3Draft:
        cls.check_policy_fit(config, {"vocab_size": policy_args.vocab_size, "hidden_size": policy_args.hidden_size})
        taps = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        if taps is None and config.get("eagle_aux_hidden_state_layer_ids"):
            taps = [i - 1 for i in config["eagle_aux_hidden_state_layer_ids"]]  # vLLM's input-of-layer ids
        if taps is not None:  # none: the default taps of this policy
            taps = cls.check_taps_fit(taps, "eagle_aux_hidden_state_layer_ids", policy_args.num_layers)
        cfg = replace(
            draft_config(config),
            family=cls.family,
            tap_layers=taps,
            draft_vocab_size=config.get("draft_vocab_size") or config["vocab_size"],
        )
        layer_args = exported_layer_args(draft_layer_args(policy_args), config)
        draft = cls(cfg, policy_args, layer_args=layer_args)
        load_checked(draft, {("fusion." + n if n.startswith("fc.") else n): t for n, t in state.items()})
        return draft


register_family(Eagle3Draft.family, Eagle3Draft, (ARCHITECTURE,))
