"""Speculative sampling must leave the target's distribution exactly as it is.

The exact joint distribution of the first three generated tokens is enumerated
from the target; 16k speculative samples drawn with a deliberately poor drafter
are compared to it with a chi-square test. Each test fails by chance with
probability 1e-3 (its stated false-alarm rate); seeds are fixed, so a given
build either passes or fails deterministically.
"""

import pytest
import torch
from scipy.stats import chisquare

from codraft.rollout import SamplingParams, generate
from codraft.rollout.sampling import probabilities
from tests.rollout.conftest import SkewedDrafter, Truncating, tiny_model

V, PROMPT, N, ALPHA = 8, [2, 5, 3], 16000, 1e-3


def exact_joint(model, params: SamplingParams) -> torch.Tensor:
    """P(t1, t2, t3 | prompt) as [V, V, V]."""
    t1, t2 = torch.meshgrid(torch.arange(V), torch.arange(V), indexing="ij")
    seqs = torch.cat([torch.tensor(PROMPT).expand(V * V, -1), t1.reshape(-1, 1), t2.reshape(-1, 1)], dim=1)
    with torch.no_grad():
        p = probabilities(model(seqs).logits[:, len(PROMPT) - 1 :], params)  # [V*V, 3, V]
    p1 = p[0, 0]  # the same for every row
    p2 = p[torch.arange(V) * V, 1]  # [t1, V]
    p3 = p[:, 2].view(V, V, V)  # [t1, t2, V]
    return p1[:, None, None] * p2[:, :, None] * p3


def exact_with_stop(joint: torch.Tensor, stop: int) -> torch.Tensor:
    """P over sequences of up to three tokens that end at the first `stop`, as [V+1]^3 (index V: ended)."""
    out = torch.zeros(V + 1, V + 1, V + 1, dtype=joint.dtype)
    go = torch.tensor([t for t in range(V) if t != stop])  # tokens after which the row goes on
    out[stop, V, V] = joint[stop].sum()
    out[go, stop, V] = joint[go, stop].sum(-1)
    out[go[:, None], go[None, :], :V] = joint[go[:, None], go[None, :]]
    return out


def sampled_counts(model, drafter, params: SamplingParams, draws: int, seed: int,
                   stop: int | None = None, adaptive: Truncating | bool = False) -> torch.Tensor:
    """Counts of the first three tokens [V]^3; with a `stop` token, of sequences that end there, [V+1]^3
    (index V after the end)."""
    counts = torch.zeros((V,) * 3 if stop is None else (V + 1,) * 3)
    for call in range(draws // 4000):
        out = generate(
            model,
            [PROMPT] * 4000,
            drafter=drafter,
            num_speculative_tokens=2,
            max_new_tokens=4,
            temperature=params.temperature,
            top_p=params.top_p,
            top_k=params.top_k,
            stop_token_ids=[] if stop is None else [stop],
            seed=seed + call,
            adaptive=adaptive,
        )
        first3 = torch.tensor([(t + [V] * 3)[:3] for t in out.tokens])
        counts.index_put_((first3[:, 0], first3[:, 1], first3[:, 2]), torch.ones(len(first3)), accumulate=True)
    return counts


def chi_square_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = (probs * counts.sum()).flatten().double()
    observed = counts.flatten().double()
    assert observed[expected == 0].sum() == 0, "sampled a sequence the target gives probability 0"
    keep = expected > 0
    expected, observed = expected[keep], observed[keep]
    # pool rare cells (and fold the pool into the smallest cell if still rare) so the approximation holds
    small = expected < 5
    exp, obs = expected[~small], observed[~small]
    if small.any():
        exp = torch.cat([exp, expected[small].sum()[None]])
        obs = torch.cat([obs, observed[small].sum()[None]])
        if exp[-1] < 5:
            i = int(exp[:-1].argmin())
            exp[i], obs[i] = exp[i] + exp[-1], obs[i] + obs[-1]
            exp, obs = exp[:-1], obs[:-1]
    return float(chisquare(obs.numpy(), exp.numpy() * obs.sum().item() / exp.sum().item()).pvalue)


@pytest.mark.parametrize(
    "params,point_mass",
    [
        (SamplingParams(1.0), False),
        (SamplingParams(1.0), True),
        (SamplingParams(0.9, top_p=0.8), False),
        (SamplingParams(1.0, top_k=5), True),
    ],
    ids=["t1-probs", "t1-point-mass", "top_p-probs", "top_k-point-mass"],
)
def test_speculative_samples_follow_the_target_distribution(params, point_mass):
    model = tiny_model(vocab_size=V, sharpen=2.0, tie_word_embeddings=False)
    drafter = SkewedDrafter(V, point_mass=point_mass)
    counts = sampled_counts(model, drafter, params, N, seed=7)
    assert chi_square_pvalue(counts, exact_joint(model, params)) > ALPHA


def test_chi_square_detects_a_wrong_distribution():
    """The test above can fail: plain sampling at another temperature is caught."""
    model = tiny_model(vocab_size=V, sharpen=2.0, tie_word_embeddings=False)
    counts = sampled_counts(model, None, SamplingParams(1.3), N, seed=7)
    assert chi_square_pvalue(counts, exact_joint(model, SamplingParams(1.0))) < ALPHA


def test_proposals_over_a_reduced_vocabulary_follow_the_target_distribution():
    """EAGLE-3's drafts carry q over its draft vocabulary only (q = 0 elsewhere): still lossless."""
    model = tiny_model(vocab_size=V, sharpen=2.0, tie_word_embeddings=False)
    drafter = SkewedDrafter(V, vocab=torch.tensor([0, 2, 3, 6]))
    counts = sampled_counts(model, drafter, SamplingParams(1.0), N, seed=11)
    assert chi_square_pvalue(counts, exact_joint(model, SamplingParams(1.0))) > ALPHA


@pytest.mark.parametrize("point_mass", [None, False, True], ids=["plain", "probs", "point-mass"])
def test_where_a_stop_token_ends_a_row_follows_the_target_distribution(point_mass):
    """A row ends at its first stop token, also one inside an accepted draft: the distribution of those endings
    (and so of response lengths) is the target's. Plain sampling checks the enumeration itself."""
    model = tiny_model(vocab_size=V, sharpen=2.0, tie_word_embeddings=False)
    params = SamplingParams(1.0)
    joint = exact_joint(model, params)
    stop = int(joint.sum((1, 2)).argsort(descending=True)[2])  # a token of moderate first-position mass
    drafter = None if point_mass is None else SkewedDrafter(V, point_mass=point_mass)
    counts = sampled_counts(model, drafter, params, N, seed=13, stop=stop)
    assert counts[stop, V, V] > 0 and counts[:V, stop, V].sum() > 0  # rows did end at the stop, at 1 and 2
    assert chi_square_pvalue(counts, exact_with_stop(joint, stop)) > ALPHA


@pytest.mark.parametrize("point_mass", [False, True], ids=["probs", "point-mass"])
def test_a_sampled_drafts_confidence_cuts_none_of_its_rows_drafts(point_mass):
    """Per-row cuts read the drafts' confidences in greedy calls only: at T=1 a controller that would cut every
    draft under 0.3 confidence feeds every row's drafts (a cut on q_i(d_i) is not lossless: test_block_verify),
    and rows whose limits leave them fewer drafts than others still follow the target's distribution."""
    model = tiny_model(vocab_size=V, sharpen=2.0, tie_word_embeddings=False)
    controller = Truncating()
    counts = sampled_counts(model, SkewedDrafter(V, point_mass=point_mass), SamplingParams(1.0), N, seed=17,
                            adaptive=controller)
    assert controller.fed[0] == 4000 * 3  # the first step of the first call: 4,000 rows x (pending + 2 drafts)
    assert chi_square_pvalue(counts, exact_joint(model, SamplingParams(1.0))) > ALPHA
