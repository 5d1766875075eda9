"""Block verification on tables: a toy target and draft over V ids whose distributions depend on the prefix.

Each of R rows drafts a chain of 3 from the draft's tables; one `verify` call judges all rows; the test then
finishes each row's first three tokens from the target's tables. Lossless means those three tokens follow the
target's exact joint (chi-square, false-alarm rate ALPHA; fixed seeds).
"""

import pytest
import torch

from codraft.rollout.verify import verify
from tests.rollout.test_lossless import chi_square_pvalue

V, K, R, ALPHA = 4, 3, 120_000, 1e-3


def tables(seed: int, sharpen: float) -> list[torch.Tensor]:
    """Distributions at positions 1..K+1 given the prefix: tables[t] is [V] * t + [V] (t = 0..K)."""
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(*(V,) * (t + 1), generator=g) * sharpen).softmax(-1) for t in range(K + 1)]


def at(table: torch.Tensor, prefix: torch.Tensor) -> torch.Tensor:
    """table's distributions [R, V] after each row's prefix [R, t]."""
    return table[tuple(prefix.T)] if prefix.shape[1] else table.expand(prefix.shape[0], V)


def exact_joint(target: list[torch.Tensor]) -> torch.Tensor:
    return target[0][:, None, None] * target[1][:, :, None] * target[2]


def draw(probs: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    return torch.multinomial(probs, 1, generator=g).squeeze(1)


def first_three(target, draft, seed, rule="block", num_drafts=None, vocab=None, point_mass=False, rig=None):
    """Counts [V]^3 of the first three tokens; `num_drafts(tokens, q)` picks each row's drafts (default K);
    `vocab`: the draft's ids (q over them only); `rig(verdict, target_probs)` corrupts the verdict (the
    test that the harness can fail)."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.zeros(R, 0, dtype=torch.long)
    q_rows = []
    for t in range(K):
        q = at(draft[t], tokens)
        if vocab is not None:
            q = q[:, vocab] / q[:, vocab].sum(-1, keepdim=True)
            token = vocab[draw(q, g)]
        else:
            token = draw(q, g)
        q_rows.append(q)
        tokens = torch.cat([tokens, token[:, None]], dim=1)
    q_all = torch.stack(q_rows, dim=1)  # [R, K, N]
    target_probs = torch.stack([at(target[t], tokens[:, :t]) for t in range(K + 1)], dim=1)  # [R, K+1, V]
    n = torch.full((R,), K) if num_drafts is None else num_drafts(tokens, q_all, vocab)
    verdict = verify(tokens, n, None if point_mass else q_all, vocab, target_probs, g, rule)
    if rig is not None:
        verdict = rig(verdict, target_probs)
    tau = verdict.num_accepted
    out = torch.cat([tokens, torch.zeros(R, 1, dtype=torch.long)], dim=1)
    out[torch.arange(R), tau] = verdict.next_token
    for t in range(1, 3):  # positions the step did not reach come from the target, as the next steps would
        later = tau + 1 <= t
        out[later, t] = draw(at(target[t], out[later, :t]), g)
    counts = torch.zeros(V, V, V)
    counts.index_put_((out[:, 0], out[:, 1], out[:, 2]), torch.ones(R), accumulate=True)
    return counts, tau


CASES = {
    "probs": {},
    "point-mass": {"point_mass": True},
    "reduced-vocab": {"vocab": torch.tensor([0, 2, 3])},
    "ragged": {"num_drafts": lambda tokens, q, vocab: torch.randint(0, K + 1, (R,),
                                                                   generator=torch.Generator().manual_seed(5))},
    # a chain that stops after a draft the draft itself gave under 0.3: decided before the next one is drawn
    "draft-stops": {"num_drafts": lambda tokens, q, vocab: stop_after_doubt(tokens, q, before=True)},
}


def stop_after_doubt(tokens: torch.Tensor, q: torch.Tensor, before: bool) -> torch.Tensor:
    """Drafts per row up to the first one whose own probability is under 0.3: kept (`before`: the chain stops
    after it) or cut (the cut reads the draft it drops)."""
    sure = q.gather(-1, tokens[..., None]).squeeze(-1) >= 0.3
    if before:
        sure = torch.cat([torch.ones_like(sure[:, :1]), sure[:, :-1]], dim=1)
    return sure.long().cumprod(-1).sum(-1)


@pytest.mark.parametrize("case", list(CASES))
def test_block_verification_follows_the_target_distribution(case):
    target, draft = tables(0, 2.0), tables(1, 2.0)
    counts, tau = first_three(target, draft, seed=3, **CASES[case])
    assert tau.max() == K
    assert chi_square_pvalue(counts, exact_joint(target)) > ALPHA


def test_the_harness_catches_a_correction_drawn_from_the_target_instead_of_the_residual():
    target, draft = tables(0, 2.0), tables(1, 2.0)
    g = torch.Generator().manual_seed(9)

    def from_target(verdict, target_probs):
        verdict.next_token = draw(target_probs[torch.arange(R), verdict.num_accepted], g)
        return verdict

    counts, _ = first_three(target, draft, seed=3, rig=from_target)
    assert chi_square_pvalue(counts, exact_joint(target)) < ALPHA


@pytest.mark.parametrize("rule", ["block", "token"])
def test_a_cut_that_reads_the_draft_it_drops_leaves_the_target_distribution(rule):
    """Why the engine cuts a sampled chain only before a draft is drawn: dropping d_i where q_i(d_i) is low
    proposes q restricted to its likely ids, which neither rule corrects for."""
    target, draft = tables(0, 2.0), tables(1, 2.0)
    counts, _ = first_three(target, draft, seed=3, rule=rule,
                            num_drafts=lambda tokens, q, vocab: stop_after_doubt(tokens, q, before=False))
    assert chi_square_pvalue(counts, exact_joint(target)) < ALPHA


def test_block_verification_keeps_more_drafts_than_token_verification():
    """The same drafts and uniforms: more accepted on average (Sun et al.'s Theorem 2), the same where each row has
    one draft."""
    target, draft = tables(0, 2.0), tables(1, 2.0)
    _, block = first_three(target, draft, seed=3)
    _, token = first_three(target, draft, seed=3, rule="token")
    gain = (block - token).float()
    assert gain.mean() > 5 * gain.std() / R ** 0.5
    one = {"num_drafts": lambda tokens, q, vocab: torch.ones(R, dtype=torch.long)}
    assert torch.equal(first_three(target, draft, seed=3, **one)[1], first_three(target, draft, seed=3, rule="token",
                                                                                  **one)[1])


def test_token_verification_follows_the_target_distribution():
    target, draft = tables(0, 2.0), tables(1, 2.0)
    counts, _ = first_three(target, draft, seed=3, rule="token")
    assert chi_square_pvalue(counts, exact_joint(target)) > ALPHA


def test_an_unknown_rule_is_refused():
    with pytest.raises(ValueError, match="rule must be 'block' or 'token'"):
        verify(torch.zeros(1, 1, dtype=torch.long), torch.ones(1, dtype=torch.long), None, None,
               torch.full((1, 2, V), 1 / V), None, "joint")
