"""Pricing a call with known lengths whole, each row at its own pace."""

import pytest
import torch

from codraft.rollout import SpeculationController, generate
from codraft.rollout.drafters import NgramDrafter
from codraft.rollout.row_pace import RowPace
from tests.rollout.test_adaptive import observe_acceptance
from tests.rollout.test_engine import PROMPTS, model_for_greedy


def test_rows_are_followed_through_the_engines_compaction_and_unverified_rows_count_as_expected():
    pace = RowPace()
    pace.start(3)
    for _ in range(6):
        pace.observe(torch.tensor([True, True, False]), torch.tensor([4, 0, 0]), 2.0)
    fast, slow, unseen = pace.ratios()
    assert fast > unseen == 1.0 > slow
    pace.keep(torch.tensor([2, 0]))  # the slow row finished; the unseen one takes its place
    assert pace.ratios() == [unseen, fast] and pace.rows() == 2 and pace.batch == 3
    pace.observe(torch.ones(5, dtype=torch.bool), torch.zeros(5), 2.0)  # not this call's rows: ignored
    assert pace.ratios() == [unseen, fast]


def primed(per_row: list[int], cost_per_row: float) -> SpeculationController:
    """A controller in a call of 4 rows, its estimate from steps of k = 4 at 0.6 per position, each row having
    accepted `per_row` drafts at each of 8 such steps. A step of t tokens per row at n rows costs
    (1 + 0.1 (t - 1)) (1 - cost_per_row + cost_per_row n / 4) decode steps of 4 rows."""
    c = SpeculationController(4)
    for rows in (1, 2, 3, 4):
        scale = 0.01 * (1 - cost_per_row + cost_per_row * rows / 4)
        for tokens, seconds in ((1, scale), (1, scale), (5, 1.4 * scale)):
            c.cost.observe(rows, tokens, seconds)
    c.new_batch(4)
    observe_acceptance(c, 0.6, rows=4, steps=8, k=4)
    for _ in range(8):
        c.observe_rows(4, torch.ones(4, dtype=torch.bool), torch.tensor(per_row))
    return c


@pytest.mark.parametrize("cost_per_row", [0.0, 1.0], ids=["cost-by-step", "cost-by-row"])
def test_a_row_that_accepts_nothing_sets_the_calls_end_where_a_step_costs_the_same_at_any_row_count(cost_per_row):
    """Three rows accept well, one accepts nothing: where a step costs what it costs at any row count (a CPU at a
    few rows) the call lasts as long as the slow row and speculating gains nothing; where it costs by the row, the
    rows done early make the rest of the call cheaper and it pays. The same acceptance spread over all four rows
    pays either way, and the rows' mean (the estimate alone) would speculate in both."""
    lagging, even = primed([2, 2, 2, 0], cost_per_row), primed([2, 2, 2, 2], cost_per_row)
    remaining = [40] * 4
    gain = max(lagging.tokens_per_second(4, k, remaining) for k in (1, 2, 3, 4)) / lagging.tokens_per_second(
        4, 0, remaining)
    assert (gain < 1) if cost_per_row == 0 else (gain > 1.1)
    assert even.tokens_per_second(4, 4, remaining) > 1.1 * even.tokens_per_second(4, 0, remaining)
    assert lagging.expected_tokens(4) / lagging.step_seconds(4, 4) > 1.1 / lagging.step_seconds(4, 0)


def test_a_batch_1_call_is_priced_by_the_estimate_alone():
    c = primed([0, 0, 0, 0], cost_per_row=0.0)
    c.new_batch(1)
    c.observe_rows(4, torch.ones(1, dtype=torch.bool), torch.tensor([0]))
    assert c.tokens_per_second(1, 4, [40]) == c.expected_tokens(4) / c.step_seconds(1, 4)


def test_the_engine_reports_each_verified_step_and_each_finished_row():
    class Always(SpeculationController):
        def __init__(self):
            super().__init__(2)
            self.seen = []

        def choose(self, rows, remaining=None):
            self.seen.append((rows, self.row_pace.rows(), self.row_pace.ratios()))
            self.probing = False
            return 2

    c = Always()
    out = generate(model_for_greedy(), PROMPTS, drafter=NgramDrafter(), num_speculative_tokens=2, temperature=0,
                   max_new_tokens=[5, 9, 12, 3], stop_token_ids=[], adaptive=c)
    assert all(rows == tracked for rows, tracked, _ in c.seen)  # rows leave the pace as they leave the batch
    assert c.row_pace.rows() == 0 and len({rows for rows, _, _ in c.seen}) > 2  # all left, not at once
    assert out.stats.draft_tokens_proposed and any(r != 1.0 for _, _, ratios in c.seen for r in ratios)
