"""GRPO loss and advantages against numbers worked out by hand."""

import math

import pytest
import torch

from codraft.rl.grpo import group_advantages, grpo_loss, masked_mean, zero_variance_groups

NAN = float("nan")


def k3(x: float) -> float:
    """exp(x) - x - 1, written out here rather than taken from the module under test."""
    return math.exp(x) - x - 1


# A hand-built batch: 3 sequences of 1..3 completion tokens, padded to T=3.
#   seq 0, A=+1.0, ratios [1.0, 1.5, 0.5]
#   seq 1, A=-1.0, ratios [0.5, 1.1, pad]
#   seq 2, A=+0.5, ratios [2.0, pad, pad]
# With eps=0.2 (clip range [0.8, 1.2]) the per-token objective -min(rA, clip(r)A) is
#   seq 0: -min(1.0, 1.0) = -1.0;  -min(1.5, 1.2) = -1.2 (clipped);  -min(0.5, 0.8) = -0.5
#   seq 1: -min(-0.5, -0.8) = 0.8 (clipped);  -min(-1.1, -1.1) = 1.1
#   seq 2: -min(1.0, 0.6) = -0.6 (clipped)
MASK = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 0, 0]], dtype=torch.bool)
RATIOS = [[1.0, 1.5, 0.5], [0.5, 1.1, 1.0], [2.0, 1.0, 1.0]]
OLD = torch.tensor([[-1.0, -2.0, -0.5], [-3.0, -1.5, NAN], [-0.7, NAN, NAN]])  # padding holds garbage
ADV = torch.tensor([1.0, -1.0, 0.5])
PER_TOKEN = [[-1.0, -1.2, -0.5], [0.8, 1.1], [-0.6]]
N_TOKENS = 6


def batch(requires_grad: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    lp = OLD.clone() + torch.tensor(RATIOS).log()
    lp[~MASK] = -torch.inf  # padding garbage must not leak into loss or gradient
    return lp.requires_grad_(requires_grad), OLD.clone()


def test_token_mean_matches_hand_computation_with_clipping():
    lp, old = batch()
    loss, metrics = grpo_loss(lp, old, ADV, MASK, aggregation="token-mean")
    expected = (-1.0 - 1.2 - 0.5 + 0.8 + 1.1 - 0.6) / 6  # = -1.4 / 6
    assert loss.item() == pytest.approx(expected, abs=1e-6)
    assert metrics["loss/policy"] == pytest.approx(expected, abs=1e-6)
    assert metrics["clip_fraction"] == pytest.approx(3 / 6)  # seq0 tok1 (high, A>0), seq1 tok0 (low, A<0), seq2 tok0
    assert metrics["ratio/mean"] == pytest.approx((1.0 + 1.5 + 0.5 + 0.5 + 1.1 + 2.0) / 6, abs=1e-6)
    assert "kl/ref" not in metrics and "kl/train_inference" not in metrics


def test_sequence_mean_matches_hand_computation():
    lp, old = batch()
    loss, _ = grpo_loss(lp, old, ADV, MASK, aggregation="sequence-mean")
    seq_means = [(-1.0 - 1.2 - 0.5) / 3, (0.8 + 1.1) / 2, -0.6 / 1]  # -0.9, 0.95, -0.6
    assert loss.item() == pytest.approx(sum(seq_means) / 3, abs=1e-6)  # -0.18333


def test_dr_grpo_divides_by_batch_times_max_tokens():
    lp, old = batch()
    loss, _ = grpo_loss(lp, old, ADV, MASK, aggregation="dr-grpo")
    assert loss.item() == pytest.approx(-1.4 / (3 * 3), abs=1e-6)  # max_tokens defaults to T = 3
    loss, _ = grpo_loss(lp, old, ADV, MASK, aggregation="dr-grpo", max_tokens=10)
    assert loss.item() == pytest.approx(-1.4 / (3 * 10), abs=1e-6)


def test_gradient_reaches_logprobs_only_and_is_zero_on_clipped_and_padded_tokens():
    lp, old = batch()
    old.requires_grad_(True)
    adv = ADV.clone().requires_grad_(True)
    loss, _ = grpo_loss(lp, old, adv, MASK)
    loss.backward()
    # d/dlp of -rA is -rA (r = exp(lp - old)); a clipped token contributes a constant, hence 0; token-mean /6
    expected = torch.tensor([[-1.0 * 1.0, 0.0, -0.5 * 1.0], [0.0, -1.1 * -1.0, 0.0], [0.0, 0.0, 0.0]]) / 6
    torch.testing.assert_close(lp.grad, expected)
    assert old.grad is None and adv.grad is None


def test_clip_higher_lets_more_ratio_through():
    lp, old = batch()
    loss, metrics = grpo_loss(lp, old, ADV, MASK, eps_low=0.2, eps_high=0.28)
    # only seq0 tok1 changes: -min(1.5, 1.28) = -1.28; seq2 tok0: -min(1.0, 1.28 * 0.5) = -0.64
    expected = (-1.0 - 1.28 - 0.5 + 0.8 + 1.1 - 0.64) / 6
    assert loss.item() == pytest.approx(expected, abs=1e-6)
    assert metrics["clip_fraction"] == pytest.approx(3 / 6)


def test_kl_penalty_adds_beta_times_k3_to_each_token():
    lp, old = batch()
    # ref - lp per valid token (the k3 argument)
    d = [[0.0, math.log(2), -math.log(2)], [math.log(2), 0.0, 0.0], [0.0, 0.0, 0.0]]
    ref = lp.detach() + torch.tensor(d)
    ref[~MASK] = NAN
    loss, metrics = grpo_loss(lp, old, ADV, MASK, beta=0.1, ref_logprobs=ref)
    kl_sum = k3(0.0) + k3(math.log(2)) + k3(-math.log(2)) + k3(math.log(2)) + k3(0.0) + k3(0.0)
    # k3(ln 2) = 2 - 0.693147 - 1 = 0.306853; k3(-ln 2) = 0.5 + 0.693147 - 1 = 0.193147
    assert kl_sum == pytest.approx(0.306853 * 2 + 0.193147, abs=1e-6)
    assert loss.item() == pytest.approx((-1.4 + 0.1 * kl_sum) / 6, abs=1e-6)
    assert metrics["kl/ref"] == pytest.approx(kl_sum / 6, abs=1e-6)
    loss.backward()
    # the KL term's gradient: d/dlp [exp(ref - lp) - (ref - lp) - 1] = 1 - exp(ref - lp); seq0 tok1 is clipped
    assert lp.grad[0, 1].item() == pytest.approx(0.1 * (1 - 2.0) / 6, abs=1e-6)


# log(pi_train / pi_inference) = old - inference per valid token: weights exp(.) =
#   seq 0: [1, 3, 0.625]   seq 1: [1.5, 1]   seq 2: [4]
IS_LOG = [[0.0, math.log(3), math.log(0.625)], [math.log(1.5), 0.0, 0.0], [math.log(4), 0.0, 0.0]]


def inference_logprobs() -> torch.Tensor:
    inf = OLD - torch.tensor(IS_LOG)
    inf[~MASK] = NAN
    return inf


def test_tis_weights_each_token_by_truncated_ratio():
    lp, old = batch()
    loss, metrics = grpo_loss(lp, old, ADV, MASK, inference_logprobs=inference_logprobs(), is_correction="tis",
                              is_cap=2.0)
    # weights min(w, 2): [1, 2, 0.625], [1.5, 1], [2]
    expected = (-1.0 * 1 - 1.2 * 2 - 0.5 * 0.625 + 0.8 * 1.5 + 1.1 * 1 - 0.6 * 2) / 6  # = -2.6125 / 6
    assert loss.item() == pytest.approx(expected, abs=1e-6)
    assert metrics["is/weight_mean"] == pytest.approx((1 + 2 + 0.625 + 1.5 + 1 + 2) / 6, abs=1e-6)
    assert metrics["is/masked_fraction"] == 0.0
    kl = (k3(0) + k3(math.log(3)) + k3(math.log(0.625)) + k3(math.log(1.5)) + k3(0) + k3(math.log(4))) / 6
    assert metrics["kl/train_inference"] == pytest.approx(kl, abs=1e-6)
    assert metrics["token_mult_prob_error"] == pytest.approx((1 + 3 + 1.6 + 1.5 + 1 + 4) / 6, abs=1e-6)
    loss.backward()
    assert lp.grad[0, 0].item() == pytest.approx(-1.0 * 1.0 * 1 / 6, abs=1e-6)  # weight is a detached constant
    assert lp.grad[0, 2].item() == pytest.approx(-0.5 * 1.0 * 0.625 / 6, abs=1e-6)


def test_token_clip_drops_tokens_outside_the_cap_band():
    lp, old = batch()
    loss, metrics = grpo_loss(lp, old, ADV, MASK, inference_logprobs=inference_logprobs(),
                              is_correction="token-clip", is_cap=2.0)
    # kept where 0.5 <= w <= 2: w = 3 (seq0 tok1) and w = 4 (seq2 tok0) are dropped
    expected = (-1.0 * 1 + 0 - 0.5 * 0.625 + 0.8 * 1.5 + 1.1 * 1 + 0) / 6  # = 0.9875 / 6
    assert loss.item() == pytest.approx(expected, abs=1e-6)
    assert metrics["is/masked_fraction"] == pytest.approx(2 / 6)


def test_inference_logprobs_without_correction_only_reports_mismatch():
    lp, old = batch()
    loss, metrics = grpo_loss(lp, old, ADV, MASK, inference_logprobs=inference_logprobs())
    assert loss.item() == pytest.approx(-1.4 / 6, abs=1e-6)
    assert metrics["token_mult_prob_error"] > 1.0 and "is/weight_mean" not in metrics


def test_matched_inference_gives_perfect_mismatch_metrics():
    lp, old = batch()
    _, metrics = grpo_loss(lp, old, ADV, MASK, inference_logprobs=old.clone(), is_correction="tis")
    assert metrics["token_mult_prob_error"] == pytest.approx(1.0)
    assert metrics["kl/train_inference"] == pytest.approx(0.0)


def test_on_policy_loss_is_minus_mean_advantage_and_handles_bf16():
    lp = torch.randn(2, 4, dtype=torch.bfloat16, requires_grad=True)
    mask = torch.ones(2, 4, dtype=torch.bool)
    loss, metrics = grpo_loss(lp, lp.detach(), torch.tensor([2.0, -1.0]), mask)
    assert loss.dtype == torch.float32
    assert loss.item() == pytest.approx(-(2.0 * 4 - 1.0 * 4) / 8)
    assert metrics["ratio/mean"] == 1.0 and metrics["clip_fraction"] == 0.0
    loss.backward()
    assert lp.grad.dtype == torch.bfloat16


def test_empty_mask_gives_zero_loss_and_zero_gradient():
    lp, old = batch()
    loss, _ = grpo_loss(lp, old, ADV, torch.zeros_like(MASK), aggregation="sequence-mean")
    loss.backward()
    assert loss.item() == 0.0 and torch.equal(lp.grad, torch.zeros_like(lp))


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"aggregation": "mean"}, "aggregation"),
        ({"is_correction": "tis"}, "inference_logprobs"),
        ({"beta": 0.1}, "ref_logprobs"),
        ({"eps_low": 1.0}, "eps_low"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"is_correction": "bogus"}, "is_correction"),
    ],
)
def test_bad_arguments_are_named(kwargs, message):
    lp, old = batch()
    with pytest.raises(ValueError, match=message):
        grpo_loss(lp, old, ADV, MASK, **kwargs)


def test_shape_mismatch_is_named():
    lp, old = batch()
    with pytest.raises(ValueError, match="old_logprobs"):
        grpo_loss(lp, old[:, :2], ADV, MASK)
    with pytest.raises(ValueError, match="advantages"):
        grpo_loss(lp, old, ADV[:2], MASK)


def test_masked_mean_ignores_masked_garbage():
    x = torch.tensor([[1.0, NAN], [3.0, 5.0]])
    m = torch.tensor([[True, False], [True, True]])
    assert masked_mean(x, m).item() == pytest.approx(3.0)
    torch.testing.assert_close(masked_mean(x, m, dim=1), torch.tensor([1.0, 4.0]))


# ---- advantages ----


def test_group_advantages_by_hand():
    # group size 3, rewards [3, 0, 0]: mean 1, deviations [2, -1, -1], unbiased var (4+1+1)/2 = 3
    adv = group_advantages(torch.tensor([3.0, 0.0, 0.0]), group_size=3, eps=0.0)
    s = math.sqrt(3)
    torch.testing.assert_close(adv, torch.tensor([2 / s, -1 / s, -1 / s]))
    # group size 2, [1, 0] -> mean 0.5, std sqrt(0.5); second group [0, 0] has zero variance -> 0
    adv = group_advantages([1.0, 0.0, 0.0, 0.0], group_size=2, eps=0.0)
    torch.testing.assert_close(adv, torch.tensor([0.5 / math.sqrt(0.5), -0.5 / math.sqrt(0.5), 0.0, 0.0]))


def test_group_advantages_eps_and_dr_grpo():
    adv = group_advantages([1.0, 0.0], group_size=2, eps=0.5)
    std = math.sqrt(0.5)
    torch.testing.assert_close(adv, torch.tensor([0.5 / (std + 0.5), -0.5 / (std + 0.5)]))
    adv = group_advantages([3.0, 0.0, 0.0, 5.0, 5.0, 5.0], group_size=3, scale_by_std=False)
    torch.testing.assert_close(adv, torch.tensor([2.0, -1.0, -1.0, 0.0, 0.0, 0.0]))


def test_dropped_rewards_get_zero_advantage_and_leave_the_group_stats():
    # group [2, None, 0]: mean over valid 1, unbiased var (1 + 1)/1 = 2; group [1, None, None]: one valid -> 0
    adv = group_advantages([2.0, None, 0.0, 1.0, None, None], group_size=3, eps=0.0)
    r = 1 / math.sqrt(2)
    torch.testing.assert_close(adv, torch.tensor([r, 0.0, -r, 0.0, 0.0, 0.0]))


def test_zero_variance_groups_mask():
    mask = zero_variance_groups([1.0, 1.0, 0.0, 1.0, None, None, 2.0, 2.0, 2.0], group_size=3)
    assert mask.tolist() == [False] * 3 + [True] * 3 + [True] * 3


def test_group_size_must_divide_rewards():
    with pytest.raises(ValueError, match="group_size"):
        group_advantages([1.0, 0.0, 1.0], group_size=2)


def test_flat_group_with_inexact_mean_gets_exactly_zero_advantage():
    adv = group_advantages([0.1, 0.1, 0.1], group_size=3, eps=0.0)  # the fp32 mean of 0.1s is not exactly 0.1
    assert adv.tolist() == [0.0, 0.0, 0.0]
