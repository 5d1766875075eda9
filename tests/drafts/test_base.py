"""What the draft families share lives in the base (drafts/base.py): the exported layer keys, the policy-fit
check of `from_export`, cache writes and attention over the draft's KV cache; and the metrics of the same
meaning carry one name in every family."""

import pytest
import torch

from codraft.drafts import build_draft
from codraft.drafts.base import DraftModel, cache_attention, write_cache
from codraft.models import KVCache
from codraft.models.cache_attention import cache_mask
from codraft.models.linear import (
    FusedLinears,
    Linear,
    bf16_packing_available,
    int8_packing_available,
    native_bf16,
    packing_available,
)
from codraft.rollout import SpeculationController, generate
from codraft.rollout.sampling import SamplingParams
from tests.drafts.blocks import draft_config, packed_batch, tiny_policy

SHARED = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
          "rms_norm_eps", "rope_theta", "rope_scaling", "max_position_embeddings", "vocab_size", "attention_bias",
          "torch_dtype")


@pytest.mark.parametrize("family", ["eagle3", "dflash", "dspark"])
def test_every_family_exports_the_base_s_layer_keys(family):
    policy = tiny_policy(dtype=torch.float32)
    draft = build_draft(draft_config(family, block_size=3, mask_token_id=7), policy)
    config = draft.export_config()
    assert {k: config[k] for k in SHARED} == draft.layer_export_config()
    assert config["vocab_size"] == policy.args.vocab_size and config["torch_dtype"] == "float32"


def test_policy_fit_check_names_the_key():
    with pytest.raises(ValueError, match="draft config hidden_size=8 does not fit the policy's hidden_size=64"):
        DraftModel.check_policy_fit({"hidden_size": 8}, {"hidden_size": 64})
    with pytest.raises(ValueError, match="vocab_size=None"):
        DraftModel.check_policy_fit({}, {"vocab_size": 40})
    DraftModel.check_policy_fit({}, {"vocab_size": 40}, required=False)


def test_cache_writes_of_valid_slots_and_attention_over_the_cache():
    args = tiny_policy(dtype=torch.float32).args
    cache = KVCache(args, 2, 8, num_layers=1, dtype=torch.float32, device="cpu")
    Hkv, D = args.num_kv_heads, args.head_dim
    k, v = torch.randn(2, 3, Hkv, D), torch.randn(2, 3, Hkv, D)
    positions = torch.tensor([[0, 1, 2], [0, 1, 7]])
    valid = torch.tensor([[True, True, True], [True, True, False]])
    write_cache(cache, 0, positions, k, v, valid)
    assert torch.equal(cache.k[0][1, :, 1], k[1, 1]) and not cache.k[0][1, :, 7].any()  # the padded slot: not written
    q = torch.randn(2, 1, args.num_heads, D)
    visible = torch.tensor([[True, True, False], [True, False, False]])[:, None]  # [B, 1, L]
    out = cache_attention(q, cache.k[0, :, :, :3], cache.v[0, :, :, :3], cache_mask(visible, 1, args, q.dtype))
    # row 1 sees only position 0: the output is its value, per query head's kv head
    group = args.num_heads // Hkv
    torch.testing.assert_close(out[1, 0], v[1, 0].repeat_interleave(group, 0))


@pytest.mark.parametrize("family,key", [("eagle3", "eagle_aux_hidden_state_layer_ids"),
                                        ("dflash", "dflash_config.target_layer_ids"),
                                        ("dspark", "dflash_config.target_layer_ids")])
def test_from_export_refuses_taps_outside_the_policy_naming_the_family_s_key(family, key):
    from codraft.drafts.export import FAMILIES

    policy = tiny_policy(dtype=torch.float32)
    draft = build_draft(draft_config(family, block_size=3, mask_token_id=7), policy)
    config, state = draft.export_config(), draft.export_state_dict()
    if family == "eagle3":
        config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [0, 1, 9]
    else:
        config["dflash_config"]["target_layer_ids"] = [9]
    layers = policy.args.num_layers
    with pytest.raises(ValueError, match=rf"draft config {key} \[9\] outside the policy's layers \[0, {layers - 1}\]"):
        FAMILIES[family].from_export(config, state, policy.args)


def test_every_family_names_its_draft_loss_and_first_position_accuracy_alike():
    """loss/draft (the loss trained on) and draft/acc_pos_k (argmax agreement at the k-th drafted position,
    EAGLE-3's TTT step k, DFlash/DSpark's slot k + 1), so dashboards compare families by one name."""
    policy = tiny_policy(dtype=torch.float32)
    names = {}
    for family in ("eagle3", "dflash", "dspark"):
        draft = build_draft(draft_config(family, block_size=3, ttt_steps=2, mask_token_id=7), policy)
        loss, metrics = draft.loss(packed_batch(policy, draft.tap_layers))
        assert metrics["loss/draft"] == pytest.approx(loss.item()), family
        names[family] = {k for k in metrics if k.startswith("draft/acc_pos_")}
    assert names["eagle3"] == names["dflash"] == names["dspark"] == {"draft/acc_pos_0", "draft/acc_pos_1"}


def decode_plainly(policy, cache, drafters, pending: torch.Tensor, steps: int) -> torch.Tensor:
    """`steps` greedy target steps whose tokens every drafter gets as commits (speculation off) -> next pending."""
    taps = drafters[0].tap_layers
    for _ in range(steps):
        feed = pending[:, None]
        with torch.no_grad():
            out = policy(feed, cache=cache, taps=taps)
        cache.advance(1)
        for drafter in drafters:
            drafter.commit(feed, torch.ones_like(pending), out.taps)
        pending = out.logits[:, -1].argmax(-1)
    return pending


@pytest.mark.parametrize("family", ["eagle3", "dflash", "dspark"])
def test_a_long_backlog_is_cut_to_its_newest_tokens_and_the_skipped_positions_are_never_attended(family):
    """After a stretch of plain steps a proposal absorbs only the newest `max_backlog` tokens; the others
    become holes. Garbage written into the holes of one drafter's cache changes none of its later proposals."""
    policy = tiny_policy()
    draft = build_draft(draft_config(family), policy).eval()
    prompts = [[3, 4, 5, 6, 3, 4, 5], [7, 8, 9], [10, 11, 12, 13]]
    B, P = len(prompts), max(map(len, prompts))
    ids = torch.zeros(B, P, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, : len(p)] = torch.tensor(p)
    lens = torch.tensor([len(p) for p in prompts])
    cache = policy.new_cache(B, 64)
    with torch.no_grad():
        out = policy(ids, cache=cache, taps=draft.tap_layers)
    cache.lengths.copy_(lens)
    drafters = [draft.drafter(), draft.drafter()]
    for drafter in drafters:
        drafter.max_backlog = 4
        drafter.start(prompts, out.taps, SamplingParams(1.0), cache.max_len, torch.Generator().manual_seed(0))
        drafter.propose(torch.tensor([1, 2, 3]), 2)  # absorbs the whole prompt
        assert not drafter.state.holes.any()
    pending = decode_plainly(policy, cache, drafters, torch.tensor([1, 2, 3]), 1)  # the prompt's pending token
    pending = decode_plainly(policy, cache, drafters, pending, 10)
    for drafter in drafters:
        drafter.propose(pending, 2)
        state = drafter.state
        assert state.holes.sum(1).tolist() == [1 + 10 - 4] * B  # 11 fresh tokens, the newest 4 absorbed
        assert state.absorbed.tolist() == (lens + 11).tolist() == state.cache.lengths.tolist()
        first_hole = state.holes.long().argmax(1)
        assert first_hole.tolist() == lens.tolist()
    noisy = drafters[1].state
    rows, positions = noisy.holes.nonzero(as_tuple=True)
    for kv in (noisy.cache.k, noisy.cache.v):
        kv[:, rows, :, positions] = 1e3 * torch.randn_like(kv[:, rows, :, positions])
    pending = decode_plainly(policy, cache, drafters, pending, 2)
    a, b = (drafter.propose(pending, 3) for drafter in drafters)
    assert torch.equal(a.tokens, b.tokens)
    torch.testing.assert_close(a.probs, b.probs, rtol=0, atol=0)


def test_a_probe_drafts_on_its_first_rows_only_and_the_others_prompts_lose_their_old_part():
    policy = tiny_policy()
    draft = build_draft(draft_config("eagle3"), policy).eval()
    long, short = list(range(3, 23)), [7, 8, 9]

    def probe(prompts, probe_rows=1, temperature=1.0):
        ids = torch.zeros(2, 20, dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, : len(p)] = torch.tensor(p)
        with torch.no_grad():
            out = policy(ids, taps=draft.tap_layers)
        drafter = draft.drafter()
        drafter.max_backlog = 4
        drafter.start(prompts, out.taps, SamplingParams(temperature), 64, torch.Generator().manual_seed(0))
        proposal = drafter.propose(torch.tensor([1, 2]), 2, probe_rows=probe_rows)
        return drafter.state, proposal

    state, proposal = probe([short, long])  # the unsampled long prompt keeps its newest 4 tokens, unabsorbed
    assert proposal.lengths.tolist() == [2, 0] and proposal.probs.shape[0] == 2
    assert state.holes.sum(1).tolist() == [0, 16] and state.absorbed.tolist() == [3, 16]
    assert state.fresh_len.tolist() == [0, 4] and state.cache.lengths.tolist() == [3, 16]
    state, proposal = probe([long, short])  # the sampled row absorbs its prompt whole
    assert proposal.lengths.tolist() == [2, 0]
    assert state.holes.sum(1).tolist() == [0, 0] and state.absorbed.tolist() == [20, 0]
    assert state.fresh_len.tolist() == [0, 3]
    # the sampled row drafts and keeps in its cache what it would have in a proposal over every row
    (state, proposal), (whole, full) = probe([long, short], temperature=0), probe([long, short], 2, temperature=0)
    assert proposal.tokens[0].tolist() == full.tokens[0].tolist()
    torch.testing.assert_close(state.cache.k[:, 0, :, :20], whole.cache.k[:, 0, :, :20])


@pytest.mark.skipif(not packing_available(), reason="this torch build has no oneDNN linear")
@pytest.mark.parametrize("family", ["eagle3", "dflash", "dspark"])
def test_rollouts_pack_the_draft_in_its_inference_dtype_and_greedy_stays_exact(family):
    """draft.inference_dtype: the draft's rollout matmuls run on int8, bf16 or fp32 copies (tap fusion, which reads
    raw taps, on float ones); greedy speculative tokens stay plain decoding's either way (the sampled case: the
    chi-square tests)."""
    policy = tiny_policy(dtype=torch.float32)
    prompts = [[3, 4, 5, 6, 3, 4, 5], [7, 8, 9]]
    kw = dict(temperature=0, max_new_tokens=10, stop_token_ids=[])
    plain = generate(policy, prompts, **kw)
    bf16 = torch.bfloat16 if bf16_packing_available() else torch.float32  # the fallback where oneDNN has none
    int8 = torch.int8 if int8_packing_available() else torch.float32
    for setting, dtype in (("float32", torch.float32), ("bfloat16", bf16), ("int8", int8)):
        draft = build_draft(draft_config(family, block_size=3, mask_token_id=7, inference_dtype=setting), policy)
        drafter = draft.drafter()
        assert drafter.model_dtype == dtype
        spec = generate(policy, prompts, drafter=drafter, num_speculative_tokens=2, **kw)
        assert spec.tokens == plain.tokens and spec.stats.draft_tokens_proposed > 0
        copies = [m.packed for m in draft.modules() if isinstance(m, Linear) and m.packed is not None]
        copies += [g.packed for m in draft.modules() for g in vars(m).values() if isinstance(g, FusedLinears)]
        fusion = draft.fusion.fc.packed
        assert copies and all(c.dtype == dtype for c in copies if c is not fusion)
        float_fusion = torch.bfloat16 if native_bf16() and bf16_packing_available() else torch.float32
        assert fusion.dtype == (dtype if dtype != torch.int8 else float_fusion)


@pytest.mark.parametrize("family", ["eagle3", "dflash", "dspark"])
def test_probes_that_draft_on_their_first_rows_only_keep_greedy_output_exact(family):
    class TwoProbesThenAStep(SpeculationController):
        steps = 0

        def choose(self, rows, remaining=None):
            self.steps += 1
            self.probing = self.steps % 3 != 0
            return 2

    policy = tiny_policy(dtype=torch.float32)
    prompts = [[3, 4, 5, 6, 3, 4, 5], [7, 8, 9], [5, 6, 7, 8, 9, 10, 11, 12], [4]]
    kw = dict(temperature=0, max_new_tokens=12, stop_token_ids=[])
    plain = generate(policy, prompts, **kw)
    draft = build_draft(draft_config(family, block_size=3, mask_token_id=7), policy)
    spec = generate(policy, prompts, drafter=draft.drafter(), num_speculative_tokens=2,
                    adaptive=TwoProbesThenAStep(2, probe_rows=2, truncate=False), **kw)
    assert spec.tokens == plain.tokens and spec.stats.draft_tokens_proposed > 0
    assert spec.stats.malformed_proposals == 0  # a rejected proposal would only log a warning
