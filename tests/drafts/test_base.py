"""What the draft families share lives in the base (drafts/base.py): the exported layer keys, the policy-fit
check of `from_export`, cache writes and attention over the draft's KV cache; and the metrics of the same
meaning carry one name in every family."""

import pytest
import torch

from codraft.drafts import build_draft
from codraft.drafts.base import DraftModel, cache_attention, write_cache
from codraft.models import KVCache
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
    out = cache_attention(q, cache.k[0, :, :, :3], cache.v[0, :, :, :3], visible)
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
