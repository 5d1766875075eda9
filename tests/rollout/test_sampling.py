"""The sampler draws each token with its probability, never one of probability zero.

Chi-square tests at a stated false-alarm rate of 1e-3 with fixed seeds, as in test_lossless.py.
"""

import pytest
import torch
from scipy.stats import chisquare

from codraft.rollout.sampling import greedy_tokens, sample

ALPHA, DRAWS = 1e-3, 40000

# zeros first, inside and last: their intervals are empty; a tiny one is drawn about 4 times in DRAWS
PROBS = torch.tensor([0.0, 0.3, 0.0, 0.2, 1e-4, 0.1999, 0.25, 0.05, 0.0])


def frequencies(probs: torch.Tensor, seed: int) -> torch.Tensor:
    draws = sample(probs.expand(DRAWS, -1), torch.Generator().manual_seed(seed))
    return torch.bincount(draws, minlength=probs.numel()).double()


def expected(probs: torch.Tensor) -> torch.Tensor:
    p = probs.double()
    return DRAWS * p / p.sum()


@pytest.mark.parametrize("scale", [1.0, 7.5])  # the sampler normalises: any positive total
def test_sample_matches_the_distribution(scale):
    counts = frequencies(PROBS * scale, seed=0)
    assert counts[PROBS == 0].sum() == 0
    seen = PROBS > 0
    assert chisquare(counts[seen], expected(PROBS[seen])).pvalue > ALPHA


def test_the_chi_square_can_fail():
    """Draws from PROBS are told apart from a distribution that moves 2% of the mass between two tokens."""
    wrong = PROBS.clone()
    wrong[1], wrong[3] = 0.32, 0.18
    counts = frequencies(PROBS, seed=0)
    seen = PROBS > 0
    assert chisquare(counts[seen], expected(wrong[seen])).pvalue < ALPHA


def test_sample_keeps_leading_dims_and_is_seeded():
    probs = torch.rand(2, 3, 50)
    a = sample(probs, torch.Generator().manual_seed(1))
    assert a.shape == (2, 3) and a.dtype == torch.long and bool(((a >= 0) & (a < 50)).all())
    assert torch.equal(a, sample(probs, torch.Generator().manual_seed(1)))


def test_point_masses_and_a_zero_last_token():
    probs = torch.zeros(4, 6)
    probs[torch.arange(4), torch.tensor([0, 2, 4, 5])] = 1.0
    assert sample(probs, None).tolist() == [0, 2, 4, 5]
    # the last token's probability is 0 while the top of the uniform's range reaches the total
    edge = torch.tensor([[1.0, 0.0], [0.5, 0.0]]).repeat(5000, 1)
    assert int(sample(edge, torch.Generator().manual_seed(0)).max()) == 0


@pytest.mark.parametrize("row", [[0.0, 0.0, 0.0], [0.5, float("nan"), 0.5], [float("inf"), 0.0, 1.0]],
                         ids=["zeros", "nan", "inf"])
def test_a_row_without_usable_mass_is_an_error_not_a_token(row):
    probs = torch.tensor([[0.2, 0.3, 0.5], row])
    with pytest.raises(ValueError, match="row 1 of probs has no positive finite mass"):
        sample(probs, None)


def test_greedy_tokens_are_argmax_with_its_first_maximum_on_ties():
    """max(-1).indices stands in for argmax(-1) in decode and verify steps: the same ids, ties included."""
    torch.manual_seed(0)
    logits = torch.randn(3, 5, 97)
    logits[0, 0, [4, 9, 60]] = 10.0  # a three-way tie: the first wins
    logits[1, 2] = 0.0  # all equal
    assert torch.equal(greedy_tokens(logits), logits.argmax(-1))
    assert greedy_tokens(logits)[0, 0] == 4 and greedy_tokens(logits)[1, 2] == 0
