"""Per-row draft lengths: calibrated draft confidence against the share of the verify forward a draft costs."""

import torch

from codraft.rollout.adaptive import SpeculationController
from codraft.rollout.calibration import DraftCalibration, DraftStop
from tests.rollout.test_adaptive import controller_with_costs


def test_an_unobserved_calibration_is_the_confidence_itself():
    cal = DraftCalibration()
    est = cal(torch.tensor([[0.95, 0.94, 0.5]]))  # cumulative 0.95, 0.893, 0.447
    torch.testing.assert_close(est, torch.tensor([[0.95, 0.8, 0.4]], dtype=torch.float64))


def test_calibration_learns_that_unsure_drafts_are_accepted_and_stays_monotone():
    cal = DraftCalibration()
    conf = torch.full((8, 1), 0.15)
    for _ in range(20):  # drafts at confidence 0.15 always accepted, at 0.6 half the time
        cal.observe(conf, verified=torch.ones(8, dtype=torch.long), accepted=torch.ones(8, dtype=torch.long))
        cal.observe(torch.full((8, 1), 0.6), verified=torch.ones(8, dtype=torch.long),
                    accepted=torch.tensor([0, 1] * 4))
    low, mid = cal(conf).flatten()[0].item(), cal(torch.full((1, 1), 0.6)).item()
    assert low > 0.9 and mid >= low  # non-decreasing in confidence, though the 0.6 bucket saw 50%
    assert torch.equal(cal.table(), cal.table().cummax(0).values)


def test_drafts_past_verified_ones_are_not_observed():
    cal = DraftCalibration()
    cal.observe(torch.full((4, 3), 0.99), verified=torch.tensor([3, 1, 0, 2]), accepted=torch.tensor([3, 0, 0, 1]))
    assert cal.trials.sum().item() == 6  # 3 + 1 + 0 + 2 drafts verified
    # cumulative 0.99, 0.98, 0.97 all fall in the top bucket: 3 + 0 + 1 accepted
    assert cal.hits.sum().item() == 4


def lengths_after_a_full_step(c, rows: int, confidence: torch.Tensor) -> torch.Tensor:
    k = confidence.shape[1]
    full = torch.full((confidence.shape[0],), k)
    assert torch.equal(c.verify_lengths(rows, k, full, confidence), full)  # a row count's first step verifies all
    return c.verify_lengths(rows, k, full, confidence)


def test_where_verification_is_dear_unsure_drafts_are_not_verified():
    c = controller_with_costs(decode_s=0.01, extra_per_token=0.5, rows=8, truncate=True)  # a draft: half a step
    conf = torch.tensor([[0.9, 0.9, 0.9, 0.9], [0.3, 0.9, 0.9, 0.9]] * 4)
    assert c.token_threshold(8, 4) == 0.5
    assert lengths_after_a_full_step(c, 8, conf).tolist() == [4, 0] * 4



def test_a_cut_that_leaves_a_forward_as_dear_as_the_whole_one_is_not_made():
    """At a few rows on a CPU a ragged forward (rows cut to different drafts) cost what the whole one does: by the
    measured cost of its mean tokens per row, cutting then only loses the drafts it drops."""
    conf = torch.tensor([[0.9, 0.9, 0.9, 0.9], [0.3, 0.9, 0.9, 0.9]] * 4)
    c = controller_with_costs(decode_s=0.01, extra_per_token=0.5, rows=8, truncate=True)
    for _ in range(2):  # the cut forward: 2 drafts a row on average + the pending token, timed as the whole one
        c.cost.observe(8, 3, c.cost(8, 5))
    assert lengths_after_a_full_step(c, 8, conf).tolist() == [4] * 8
    assert not c.truncate or SpeculationController(4).truncate is False  # off unless asked for


def test_where_verification_is_cheap_every_draft_is_verified():
    c = controller_with_costs(decode_s=0.01, extra_per_token=0.02, rows=1, truncate=True)
    assert lengths_after_a_full_step(c, 1, torch.tensor([[0.5, 0.5, 0.5, 0.5]])).tolist() == [4]


def test_one_step_in_refresh_every_verifies_all_drafts_and_a_probe_those_of_a_few_rows():
    c = controller_with_costs(decode_s=0.01, extra_per_token=0.5, rows=8, truncate=True)
    conf, full = torch.full((8, 4), 0.3), torch.full((8,), 4)
    fed = [int(c.verify_lengths(8, 4, full, conf).sum()) for _ in range(2 * c.refresh_every)]
    assert fed.count(32) == 2 and fed[0] == 32 and fed[c.refresh_every] == 32
    c.probing = True  # a probe verifies all drafts of its first probe_rows rows, none of the others
    assert c.verify_lengths(8, 4, full, conf).tolist() == [4] * c.probe_rows + [0] * (8 - c.probe_rows)
    assert torch.equal(c.verify_lengths(2, 4, full[:2], conf[:2]), full[:2])
    assert torch.equal(controller_with_costs(0.01, 0.5, rows=8).__class__(4, truncate=False)
                       .verify_lengths(8, 4, full, conf), full)


def test_a_step_cost_counts_only_the_drafts_verified():
    """Truncated steps verify ~1 draft per row of k = 4: the step is priced at 2 tokens per row, not 5, and the
    cost model learns nothing from those partial shapes."""
    c = controller_with_costs(decode_s=0.01, extra_per_token=0.5, rows=8)
    c.cost.observe(8, 2, 0.012)
    c.cost.observe(8, 2, 0.012)
    before = c.cost(8, 5)
    for _ in range(5):
        c.observe(4, [8, 4, 2, 1], [4, 2, 1, 0], 8, verify_s=0.013, draft_s=0.001, fed=16)
    assert c.cost(8, 5) == before and abs(c.verified_drafts(4) - 1.0) < 1e-9
    assert abs(c.step_seconds(8, 4) - (c.cost(8, 2) + c.draft_cost(4, 8))) < 1e-9
    assert abs(c.verified_drafts(2) - 0.5) < 1e-9  # an unseen k: the share of the nearest seen one


def test_the_calibration_learns_only_where_cuts_or_stops_read_it():
    conf, verified = torch.full((2, 3), 0.5), torch.tensor([3, 3])
    for truncate, stop, stops_early in ((False, False, True), (True, False, False), (False, True, True),
                                        (False, True, False)):
        c = SpeculationController(4, truncate=truncate, draft_stop=stop)
        c.new_batch(2, stops_early=stops_early)  # a greedy call with a chain draft
        c.observe_drafts(conf, verified, torch.tensor([1, 2]))
        assert c.calibration.trials.sum().item() == (6 if truncate or (stop and stops_early) else 0)


def test_a_draft_stops_where_the_next_draft_is_not_worth_its_cost():
    """The next draft is priced at the last one's confidence again: after 0.9 (cumulative 0.9, next 0.81: prior 0.8)
    go on at a price of 0.5, after 0.9 then 0.3 (next 0.9 * 0.3 * 0.3 = 0.081: prior 0.075) stop; over two rows
    their sum is what pays."""
    stop = DraftStop(DraftCalibration(), min_accepted=0.5)
    assert not stop(torch.tensor([[0.9]]))
    assert stop(torch.tensor([[0.9, 0.3]]))
    assert not DraftStop(DraftCalibration(), min_accepted=0.8)(torch.tensor([[0.9, 0.3], [0.95, 0.95]]))
    assert len(stop.position_s) == 1 and stop.position_s[0] >= 0  # the seconds between its two calls
