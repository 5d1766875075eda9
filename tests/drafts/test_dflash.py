"""DFlash: anchors, the block loss against an unrolled reference, inference cache, lossless proposals, export."""

import pytest
import torch

from codraft.drafts.anchors import pad_anchors, sample_anchors, valid_anchors
from codraft.drafts.dflash import DFlashDraft, default_tap_layers, pick_mask_token
from codraft.rollout import SamplingParams
from codraft.rollout.sampling import probabilities
from tests.drafts.blocks import (
    ANCHORS,
    MASK_ID,
    check_export_round_trip,
    check_greedy,
    check_lossless,
    check_reduced_vocab,
    draft_config,
    grads,
    lossless_draft,
    make_draft,
    packed_batch,
    reference_slots,
    tiny_policy,
)

# --- anchors ---


def _brute_force_valid(loss_mask, cu, b):
    valid = torch.zeros_like(loss_mask)
    for start, end in zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True):
        for a in range(start, end - b + 1):
            valid[a] = bool(loss_mask[a]) and bool(loss_mask[a + 1 : a + b].any())
    return valid


def test_valid_anchors_open_blocks_inside_their_sequence_with_a_response_target():
    g = torch.Generator().manual_seed(0)
    cu = torch.tensor([0, 9, 10, 10, 25, 31])  # includes a one-token and an empty sequence
    loss_mask = torch.rand(31, generator=g) > 0.4
    for b in (2, 4, 7):
        assert torch.equal(valid_anchors(loss_mask, cu, b), _brute_force_valid(loss_mask, cu, b))


def test_sample_anchors_is_deterministic_and_takes_up_to_num_anchors_per_sequence():
    cu = torch.tensor([0, 12, 20, 40])
    loss_mask = torch.ones(40, dtype=torch.bool)
    loss_mask[[0, 1, 12, 20, 21, 22]] = False
    valid = valid_anchors(loss_mask, cu, 4)
    draws = [sample_anchors(loss_mask, cu, 4, 3, torch.Generator().manual_seed(s)) for s in (5, 5, 6)]
    assert torch.equal(draws[0], draws[1])
    assert not torch.equal(draws[0], draws[2])
    for anchors in draws:
        assert valid[anchors].all()
        assert torch.equal(torch.bucketize(anchors, cu[1:], right=True).bincount(minlength=3), torch.tensor([3, 3, 3]))
    everything = sample_anchors(loss_mask, cu, 4, 100, torch.Generator().manual_seed(0))
    assert torch.equal(everything, valid.nonzero().flatten())


def test_pad_anchors_rounds_the_count_up_with_unreal_copies_of_the_last():
    anchors, real = pad_anchors(torch.tensor([3, 9, 14]), 4)
    assert anchors.tolist() == [3, 9, 14, 14] and real.tolist() == [True, True, True, False]
    anchors, real = pad_anchors(torch.tensor([3, 9, 14, 20]), 4)
    assert anchors.tolist() == [3, 9, 14, 20] and bool(real.all())
    anchors, real = pad_anchors(torch.tensor([], dtype=torch.long), 4)
    assert anchors.numel() == real.numel() == 0


def test_default_taps_spread_from_layer_1_to_l_minus_3_and_pick_mask_token():
    assert default_tap_layers(36, 5) == [1, 9, 17, 25, 33]  # z-lab's Qwen3-8B drafts
    assert default_tap_layers(30, 2) == [1, 27]
    assert default_tap_layers(30, 1) == [15]
    assert default_tap_layers(2, 3) == [1]  # deduplicated for tiny policies
    assert pick_mask_token(259, 320) == 259  # padded model vocab: the first id the tokenizer never produces
    assert pick_mask_token(320, 320, special_ids=[5, 17, 3]) == 17
    assert pick_mask_token(320, 320) == 319


# --- training ---


# five anchors with num_anchors = 2: the loss pads them to six with a block it weighs 0
@pytest.mark.parametrize("impl,anchors", [("fused", ANCHORS), ("dense", ANCHORS), ("fused", ANCHORS[:5])])
def test_block_loss_and_grads_match_an_unrolled_reference(impl, anchors):
    draft, policy = make_draft()
    draft.attention_impl = impl
    batch = packed_batch(policy, draft.tap_layers)
    loss, metrics = draft.loss(batch, anchors=anchors)
    loss.backward()
    got = grads(draft)

    draft.zero_grad()
    num = den = 0.0
    for _, logits, policy_logits, _, _, w in reference_slots(draft, policy, batch, anchors):
        soft_ce = -(policy_logits.softmax(-1) * logits.log_softmax(-1)).sum()
        num, den = num + w * soft_ce, den + w
    ref = num / den
    ref.backward()
    want = grads(draft)

    torch.testing.assert_close(loss.double(), ref, rtol=1e-6, atol=1e-6)
    assert got.keys() == want.keys() == dict(draft.named_parameters()).keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-7, msg=lambda m, n=name: f"{n}: {m}")
    assert metrics["draft/anchors"] == len(anchors) and 0 <= metrics["draft/expected_accept"] <= 1
    assert {"loss/draft", "draft/acc_pos_0", "draft/acc_pos_2"} <= metrics.keys()


def test_no_gradient_reaches_the_policy():
    draft, policy = make_draft()
    batch = packed_batch(policy, draft.tap_layers)
    loss, _ = draft.loss(batch, generator=torch.Generator().manual_seed(0))
    loss.backward()
    assert all(p.grad is None for p in policy.parameters())
    assert all(p.grad is not None for p in draft.parameters())
    assert not any(name.startswith(("embed", "lm_head")) for name in draft.state_dict())


def test_a_batch_without_response_gives_zero_loss_and_finite_grads():
    draft, policy = make_draft()
    batch = packed_batch(policy, draft.tap_layers)
    batch.loss_mask[:] = False
    loss, _ = draft.loss(batch, generator=torch.Generator().manual_seed(0))
    loss.backward()
    assert loss.item() == 0.0
    assert all(torch.isfinite(g).all() for g in grads(draft).values())


# --- inference ---


def test_incremental_context_cache_equals_a_fresh_full_forward():
    """Absorbing ragged chunks writes the K/V a full forward gives, and each proposal's distributions equal
    the training path's for a block anchored at the pending token."""
    draft, policy = make_draft()
    g = torch.Generator().manual_seed(3)
    lengths = [13, 7, 16]
    seqs = [torch.randint(0, MASK_ID, (n,), generator=g) for n in lengths]
    taps = [policy(s[None], taps=draft.tap_layers).taps for s in seqs]
    feats = [draft.fuse(t)[0].detach() for t in taps]  # [n, H]
    concat = [draft.concat_taps(t)[0].detach() for t in taps]  # [n, n_taps * H], what the engine commits
    chunks = torch.tensor([[3, 1, 6], [2, 3, 1], [4, 1, 5], [1, 1, 2]])  # tokens committed per step and row
    state = draft.new_state(3, 32)
    done = torch.zeros(3, dtype=torch.long)
    params = SamplingParams(1.0)
    for counts in chunks:
        width = int(counts.max())
        step_taps = torch.zeros(3, width, concat[0].shape[-1], dtype=concat[0].dtype)
        step_ids = torch.zeros(3, width, dtype=torch.long)
        for r in range(3):
            n0, n1 = int(done[r]), int(done[r] + counts[r])
            step_taps[r, : n1 - n0], step_ids[r, : n1 - n0] = concat[r][n0:n1], seqs[r][n0:n1]
        state.append(step_taps, step_ids, counts)
        done += counts
        pending = torch.stack([seqs[r][int(done[r])] for r in range(3)])
        proposal = draft.propose(state, pending, 5, params)

        # the training path: the same blocks over the packed committed prefixes (+ pending) of all rows
        context = torch.cat([feats[r][: int(done[r]) + 1] for r in range(3)])
        cu = torch.nn.functional.pad((done + 1).cumsum(0), (1, 0))
        positions = torch.cat([torch.arange(int(done[r]) + 1) for r in range(3)])
        hidden = draft.block_hidden(context, cu, positions, cu[1:] - 1, pending)[:, 1:4]
        want = probabilities(draft.slot_logits(hidden, pending[:, None].expand(3, 3)), params)
        assert proposal.tokens.shape == (3, 3) and proposal.lengths.tolist() == [3, 3, 3]
        torch.testing.assert_close(proposal.probs, want, rtol=1e-5, atol=1e-7)
    assert state.absorbed.tolist() == done.tolist()
    for i in range(len(draft.layers)):
        for r in range(3):
            n = int(done[r])
            k, v = draft.context_kv(i, feats[r][:n], torch.arange(n))  # [n, Hkv, D]
            torch.testing.assert_close(state.cache.k[i, r, :, :n], k.transpose(0, 1))
            torch.testing.assert_close(state.cache.v[i, r, :, :n], v.transpose(0, 1))


def test_dflash_proposals_keep_sampling_lossless():
    check_lossless(*lossless_draft(DFlashDraft), SamplingParams(1.0))


def test_greedy_speculative_equals_greedy_plain_on_ragged_prompts():
    check_greedy(DFlashDraft)


# --- config and export ---


@pytest.mark.parametrize(
    "overrides,field",
    [
        ({"block_size": 1}, "draft.block_size"),
        ({"tap_layers": [0, 6]}, "draft.tap_layers"),
        ({"mask_token_id": 40}, "draft.mask_token_id"),
    ],
)
def test_bad_config_raises_naming_the_field(overrides, field):
    policy = tiny_policy()
    with pytest.raises(ValueError, match=field):
        DFlashDraft(draft_config("dflash", **overrides), policy.args)


def test_export_round_trip_gives_identical_proposals(tmp_path):
    config = check_export_round_trip(DFlashDraft, tmp_path / "dflash")
    assert config["dflash_config"] == {"target_layer_ids": [1], "mask_token_id": 47, "block_size": 4}


def test_reduced_vocab_proposals_keep_sampling_lossless():
    draft, model = lossless_draft(DFlashDraft, draft_vocab_size=5)  # tokens 5-7 come only from the target's residual
    assert draft.head_vocab.tolist() == [0, 1, 2, 3, 4]
    check_lossless(draft, model, SamplingParams(1.0))


def test_reduced_vocab_greedy_speculative_equals_greedy_plain():
    check_greedy(DFlashDraft, draft_vocab_size=20)


def test_reduced_vocab_head_is_the_policy_heads_rows_and_is_exported(tmp_path):
    check_reduced_vocab(DFlashDraft, tmp_path / "draft")
