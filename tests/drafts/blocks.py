"""Shared fixtures and checks of the DFlash/DSpark tests, and a reference block forward.

The reference unrolls the draft forward one anchor at a time: it builds the block
[x_a, MASK...] itself and attends with an explicit boolean mask over
[all context keys ; the block's keys], visible = same sequence and position < a
for the context, everything for the block. It reuses the draft's weights (norms,
projections, MLP) but none of its attention or block plumbing.
"""

from __future__ import annotations

import json
import math

import torch
from safetensors.torch import load_file, save_file

from codraft.config import DraftConfig
from codraft.drafts.base import DraftBatch
from codraft.drafts.dflash import DFlashDraft
from codraft.drafts.export import export_draft, load_draft
from codraft.models import ModelArgs, Transformer
from codraft.rollout import generate
from tests.rollout.conftest import tiny_model
from tests.rollout.test_lossless import ALPHA, N, chi_square_pvalue, exact_joint, sampled_counts

V = 40
MASK_ID = V - 1
# three packed sequences of unequal lengths; the second has no prompt, the third a masked tool span
LENS, PROMPT_LENS = [11, 7, 14], [3, 0, 5]
CU = torch.nn.functional.pad(torch.tensor(LENS).cumsum(0), (1, 0))  # [0, 11, 18, 32]
RAGGED_PROMPTS = [[3, 4, 5, 6, 3, 4, 5], [7, 8, 9], [10, 11, 12, 13, 14, 15, 10, 11, 12, 13], [20]]  # generation
# first response tokens (3, 11, 23), a sequence start (11: no context at all), a block with masked targets (27)
ANCHORS = torch.tensor([3, 6, 11, 13, 23, 27])


def tiny_policy(dtype: torch.dtype = torch.float64, num_layers: int = 6, seed: int = 0) -> Transformer:
    torch.manual_seed(seed)
    args = ModelArgs(
        vocab_size=V,
        hidden_size=32,
        intermediate_size=64,
        num_layers=num_layers,
        num_heads=4,
        num_kv_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    return Transformer(args).to(dtype)


def draft_config(family: str, **overrides) -> DraftConfig:
    return DraftConfig(
        **{"family": family, "num_layers": 2, "block_size": 4, "num_anchors": 2, "mask_token_id": MASK_ID} | overrides
    )


def packed_batch(policy: Transformer, taps: tuple[int, ...], seed: int = 1) -> DraftBatch:
    """Random tokens in LENS with the policy's detached taps and logits, as the trainer hands them over."""
    g = torch.Generator().manual_seed(seed)
    T = int(CU[-1])
    ids = torch.randint(0, V - 1, (T,), generator=g)
    loss_mask = torch.ones(T, dtype=torch.bool)
    for start, n in zip(CU[:-1].tolist(), PROMPT_LENS, strict=True):
        loss_mask[start : start + n] = False
    loss_mask[29:31] = False  # a tool output inside the third response
    out = policy(ids[None], cu_seqlens=CU, taps=taps)
    return DraftBatch(ids, {i: t[0].detach() for i, t in out.taps.items()}, out.logits[0].detach(), loss_mask, CU)


def explicit_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    """q [Lq, H, D], k/v [Lk, Hkv, D], visible [Lk] bool -> [Lq, H, D]."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(q.shape[-1])
    scores = scores.masked_fill(~visible, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def reference_block_hidden(draft, policy: Transformer, batch: DraftBatch, anchors: torch.Tensor) -> torch.Tensor:
    """[G, b, H] final-normed hidden states of the blocks at `anchors`, one anchor at a time."""
    b, T = draft.block_size, batch.input_ids.numel()
    embed = policy.embed_tokens.weight.detach()
    context = draft.fusion.norm(draft.fusion.fc(torch.cat([batch.taps[i] for i in draft.tap_layers], -1)))
    seq = torch.arange(len(CU) - 1).repeat_interleave(CU.diff())
    pos = torch.arange(T) - CU[seq]
    cos_c, sin_c = draft.rotary(pos, context.dtype)
    blocks = []
    for a in anchors.tolist():
        x = embed[torch.tensor([int(batch.input_ids[a])] + [draft.mask_token_id] * (b - 1))]  # [b, H]
        cos_b, sin_b = draft.rotary(pos[a] + torch.arange(b), x.dtype)
        visible = torch.cat([(seq == seq[a]) & (torch.arange(T) < a), torch.ones(b, dtype=torch.bool)])
        for layer in draft.layers:
            h = layer.input_layernorm(x)
            k_ctx, v_ctx = layer.self_attn.kv(context, cos_c, sin_c)
            q, k_blk, v_blk = layer.self_attn.qkv(h, cos_b, sin_b)
            out = explicit_attention(q, torch.cat([k_ctx, k_blk]), torch.cat([v_ctx, v_blk]), visible)
            x = layer.finish(out, x)
        blocks.append(draft.norm(x))
    return torch.stack(blocks)


def reference_slots(draft, policy: Transformer, batch: DraftBatch, anchors: torch.Tensor):
    """Per anchor and slot k = 1..b-1: (hidden [H], head logits [V], policy logits [V], target, prev token, weight)."""
    hidden = reference_block_hidden(draft, policy, batch, anchors)
    head = policy.lm_head.weight.detach()
    for g, a in enumerate(anchors.tolist()):
        for k in range(1, draft.block_size):
            weight = math.exp(-(k - 1) / draft.cfg.gamma) * float(batch.loss_mask[a + k])
            yield (
                hidden[g, k],
                hidden[g, k] @ head.T,
                batch.policy_logits[a + k - 1],
                batch.input_ids[a + k],
                batch.input_ids[a + k - 1],
                weight,
            )


def grads(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.grad.clone() for name, p in module.named_parameters() if p.grad is not None}


def make_draft(cls=DFlashDraft, policy=None, **overrides):
    policy = policy if policy is not None else tiny_policy()
    draft = cls(draft_config(cls.family, **overrides), policy.args).to(policy.lm_head.weight.dtype)
    return draft.attach(policy), policy


def lossless_draft(cls, **overrides):
    """A draft for test_lossless's 2-layer, vocab-8 policy, tapping both layers, MASK inside the vocab."""
    model = tiny_model(vocab_size=8, sharpen=2.0, tie_word_embeddings=False)
    cfg = draft_config(cls.family, num_layers=1, block_size=3, tap_layers=[0, 1], mask_token_id=7, **overrides)
    return cls(cfg, model.args).attach(model), model


def check_lossless(draft, model, params):
    counts = sampled_counts(model, draft.drafter(), params, N, seed=11)
    assert chi_square_pvalue(counts, exact_joint(model, params)) > ALPHA


def check_greedy(cls, **overrides):
    model = tiny_model(vocab_size=48, sharpen=3.0, tie_word_embeddings=False, num_layers=4)
    draft = cls(draft_config(cls.family, mask_token_id=47, **overrides), model.args).attach(model)
    kw = dict(temperature=0, max_new_tokens=20, stop_token_ids=[1, 2])
    plain = generate(model, RAGGED_PROMPTS, **kw)
    for k in (2, 5):  # k > b-1 proposes b-1
        spec = generate(model, RAGGED_PROMPTS, drafter=draft.drafter(), num_speculative_tokens=k, **kw)
        assert spec.tokens == plain.tokens
        assert spec.stats.draft_tokens_proposed > 0 and spec.stats.malformed_proposals == 0


def check_export_round_trip(cls, out_dir, **overrides):
    model = tiny_model(vocab_size=48, sharpen=2.0, tie_word_embeddings=False, num_layers=4)
    draft = cls(draft_config(cls.family, mask_token_id=47, **overrides), model.args).attach(model)
    for p in draft.parameters():  # move every weight off its init, so a dropped one shows
        p.data.add_(torch.randn_like(p) * 0.1)
    export_draft(draft, out_dir)
    config = json.loads((out_dir / "config.json").read_text())
    assert config["architectures"] == [cls.architecture] and config["codraft_family"] == cls.family
    assert {"fc.weight", "hidden_norm.weight", "norm.weight", "layers.1.self_attn.k_norm.weight"} <= set(
        load_file(out_dir / "model.safetensors")
    )
    rebuilt = load_draft(out_dir, model)
    assert type(rebuilt) is cls and rebuilt.export_config() == draft.export_config()
    outs = []
    for d in (draft, rebuilt):
        outs.append(generate(model, RAGGED_PROMPTS, drafter=d.drafter(), max_new_tokens=12, stop_token_ids=[], seed=3))
    assert outs[0].tokens == outs[1].tokens
    assert outs[0].stats.draft_tokens_accepted == outs[1].stats.draft_tokens_accepted
    return config


def check_reduced_vocab(cls, out_dir):
    """A draft vocabulary of 20 of 48 tokens: the inference head is the policy head's rows for them, follows
    in-place updates of the policy head, survives export; an export without it drafts the whole vocabulary."""
    model = tiny_model(vocab_size=48, sharpen=3.0, tie_word_embeddings=False, num_layers=4)
    counts = torch.zeros(48, dtype=torch.long)
    counts[torch.arange(20) * 2] = 5  # the even ids are the frequent ones
    draft = cls(draft_config(cls.family, mask_token_id=47, draft_vocab_size=20, inference_dtype="float32"),
                model.args, token_counts=counts).attach(model)
    assert draft.head_vocab.tolist() == list(range(0, 40, 2))
    hidden = torch.randn(2, 3, model.args.hidden_size, dtype=model.lm_head.weight.dtype)
    with torch.no_grad():
        torch.testing.assert_close(draft.head_logits(hidden), model.lm_head(hidden)[..., draft.head_vocab])
        model.lm_head.weight.mul_(2)  # an optimizer step: in place, the version counter moves
        torch.testing.assert_close(draft.head_logits(hidden), model.lm_head(hidden)[..., draft.head_vocab])
        draft.cfg.inference_dtype = "bfloat16"  # bf16 copies of the same rows, fp32 logits
        logits = draft.head_logits(hidden)
        assert logits.dtype == torch.float32
        torch.testing.assert_close(logits, model.lm_head(hidden)[..., draft.head_vocab], rtol=2e-2, atol=2e-2)
    export_draft(draft, out_dir)
    assert load_file(out_dir / "model.safetensors")["head_vocab"].tolist() == draft.head_vocab.tolist()
    rebuilt = load_draft(out_dir, model)
    assert rebuilt.head_vocab.tolist() == draft.head_vocab.tolist()
    state = load_file(out_dir / "model.safetensors")
    del state["head_vocab"]
    save_file(state, out_dir / "model.safetensors")
    assert load_draft(out_dir, model).head_vocab is None
