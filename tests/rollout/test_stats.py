"""RolloutStats: several generate calls added into one record."""

from codraft.rollout import RolloutStats


def test_merge_adds_counts_times_and_per_position_acceptance():
    a = RolloutStats(rows=2, tokens_generated=10, row_verifies=4, tokens_from_verifies=8, k_chosen=[2, 0],
                     time_verify_s=0.5)
    a.count_positions([4, 2], [3, 1])
    b = RolloutStats(rows=1, tokens_generated=5, row_verifies=3, tokens_from_verifies=3, k_chosen=[3],
                     time_verify_s=0.25)
    b.count_positions([1, 1, 1], [1, 0, 0])
    a.merge(b)
    assert (a.rows, a.tokens_generated, a.k_chosen, a.time_verify_s) == (3, 15, [2, 0, 3], 0.75)
    assert a.acceptance_length == 11 / 7
    assert (a.proposed_per_position, a.accepted_per_position) == ([5, 3, 1], [4, 1, 0])
