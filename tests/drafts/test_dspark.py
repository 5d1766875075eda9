"""DSpark: the Markov head and CE/TV mix against the unrolled reference; left-to-right drafts stay lossless."""

import pytest
import torch
import torch.nn.functional as F

from codraft.drafts.dspark import DSparkDraft
from codraft.rollout import SamplingParams
from codraft.rollout.sampling import probabilities
from tests.drafts.blocks import (
    ANCHORS,
    check_export_round_trip,
    check_greedy,
    check_lossless,
    check_reduced_vocab,
    grads,
    lossless_draft,
    make_draft,
    packed_batch,
    reference_slots,
)


def markov_draft(scale: float = 1.0, **overrides):
    """A DSpark draft whose Markov head is switched on (W2 starts at zero)."""
    draft, policy = make_draft(DSparkDraft, **overrides)
    with torch.no_grad():
        draft.markov.w2.weight.normal_(std=scale)
    return draft, policy


@pytest.mark.parametrize("impl", ["fused", "dense"])
def test_mixed_loss_with_markov_bias_and_confidence_matches_an_unrolled_reference(impl):
    draft, policy = markov_draft(markov_rank=8, confidence_head=True)
    draft.attention_impl = impl
    batch = packed_batch(policy, draft.tap_layers)
    loss, metrics = draft.loss(batch, anchors=ANCHORS)
    loss.backward()
    got = grads(draft)

    draft.zero_grad()
    mix = conf = den = 0.0
    for hidden, head_logits, policy_logits, _, prev, w in reference_slots(draft, policy, batch, ANCHORS):
        logits = head_logits + draft.markov.w2.weight @ draft.markov.w1.weight[prev]  # teacher-forced bias
        p, log_q = policy_logits.softmax(-1), logits.log_softmax(-1)
        ce, tv = -(p * log_q).sum(), 0.5 * (p - log_q.exp()).abs().sum()
        accept = torch.minimum(p, log_q.exp()).sum().detach()
        score = draft.confidence(hidden.detach()).squeeze()
        bce = -(accept * F.logsigmoid(score) + (1 - accept) * F.logsigmoid(-score))
        mix, conf, den = mix + w * (0.1 * ce + 0.9 * tv), conf + w * bce, den + w
    ref = (mix + conf) / den
    ref.backward()
    want = grads(draft)

    torch.testing.assert_close(loss.double(), ref, rtol=1e-6, atol=1e-6)
    assert got.keys() == want.keys() == dict(draft.named_parameters()).keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-7, msg=lambda m, n=name: f"{n}: {m}")
    assert {"loss/draft_ce", "loss/draft_tv", "loss/draft_confidence"} <= metrics.keys()


def test_a_fresh_dspark_drafts_as_its_dflash_backbone():
    draft, policy = make_draft(DSparkDraft)
    batch = packed_batch(policy, draft.tap_layers)
    assert not draft.markov.w2.weight.any()
    hidden = torch.randn(3, 5, policy.args.hidden_size, dtype=torch.float64)
    prev = torch.randint(0, policy.args.vocab_size, (3, 5))
    torch.testing.assert_close(draft.slot_logits(hidden, prev), draft.policy_head(hidden))
    assert torch.isfinite(draft.loss(batch, anchors=ANCHORS)[0])


def test_each_slot_reports_its_distribution_given_the_previous_draft():
    """Left-to-right sampling: q of slot k is the teacher-forced distribution with the drafted token k-1."""
    draft, policy = markov_draft(scale=3.0)
    prompts = torch.tensor([[3, 4, 5, 6, 7], [8, 9, 10, 11, 12]])
    state = draft.new_state(2, 32)
    state.append(draft.concat_taps(policy(prompts, taps=draft.tap_layers).taps), prompts, torch.tensor([5, 3]))
    pending = torch.tensor([13, 14])
    params = SamplingParams(0.8, top_k=20)
    state.generator = torch.Generator().manual_seed(0)
    proposal = draft.propose(state, pending, 3, params)

    cu = torch.tensor([0, 6, 10])  # the rows' committed tokens + pending, packed
    packed = torch.tensor([[3, 4, 5, 6, 7, 13, 8, 9, 10, 14]])
    context = draft.fuse(policy(packed, cu_seqlens=cu, taps=draft.tap_layers).taps)[0]
    positions = torch.tensor([0, 1, 2, 3, 4, 5, 0, 1, 2, 3])
    hidden = draft.block_hidden(context, cu, positions, torch.tensor([5, 9]), pending)[:, 1:]
    prev = torch.cat([pending[:, None], proposal.tokens[:, :-1]], 1)
    torch.testing.assert_close(proposal.probs, probabilities(draft.slot_logits(hidden, prev), params))
    assert proposal.probs.gather(-1, proposal.tokens[..., None]).gt(0).all()


def test_dspark_proposals_keep_sampling_lossless():
    draft, model = lossless_draft(DSparkDraft)
    with torch.no_grad():
        draft.markov.w2.weight.normal_(std=2.0)  # a strong previous-token dependence
    check_lossless(draft, model, SamplingParams(1.0))


def test_greedy_speculative_equals_greedy_plain_on_ragged_prompts():
    check_greedy(DSparkDraft)


def test_export_round_trip_gives_identical_proposals(tmp_path):
    config = check_export_round_trip(DSparkDraft, tmp_path / "dspark", markov_rank=8, confidence_head=True)
    assert config["markov_rank"] == 8 and config["confidence_head"] is True


def test_reduced_vocab_proposals_keep_sampling_lossless():
    draft, model = lossless_draft(DSparkDraft, draft_vocab_size=5)  # tokens 5-7 come only from the target's residual
    assert draft.head_vocab.tolist() == [0, 1, 2, 3, 4]
    with torch.no_grad():
        draft.markov.w2.weight.normal_(std=2.0)  # the Markov bias over the draft vocabulary takes part
    check_lossless(draft, model, SamplingParams(1.0))


def test_reduced_vocab_greedy_speculative_equals_greedy_plain():
    check_greedy(DSparkDraft, draft_vocab_size=20)


def test_reduced_vocab_head_is_the_policy_heads_rows_and_is_exported(tmp_path):
    check_reduced_vocab(DSparkDraft, tmp_path / "draft")
