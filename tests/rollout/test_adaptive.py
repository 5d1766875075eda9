"""The speculation controller: k from acceptance and measured cost, cheap to learn, off when it does not pay."""

import random

import pytest

from codraft.rollout.adaptive import SpeculationController, VerifyCostModel


def controller_with_costs(decode_s: float, extra_per_token: float, rows: int = 1, max_k: int = 4,
                          truncate: bool = False):
    """A controller whose cost model observed two decode steps and a (max_k + 1)-token verify at `rows`."""
    c = SpeculationController(max_k, truncate=truncate)
    c.cost.observe(rows, 1, decode_s)
    c.cost.observe(rows, 1, decode_s)
    c.cost.observe(rows, max_k + 1, decode_s * (1 + extra_per_token * max_k))
    return c


def observe_acceptance(c: SpeculationController, rate: float, rows: int, steps: int, k: int) -> float:
    """`steps` steps of k drafts accepted at `rate` per position -> tokens each row emitted in them."""
    emitted = 0.0
    for _ in range(steps):
        reached, accepted, alive = [], [], float(rows)
        for _ in range(k):
            reached.append(round(alive))
            alive *= rate
            accepted.append(round(alive))
        c.observe(k, reached, accepted, rows, verify_s=c.cost(rows, k + 1), draft_s=0.001 * k)
        emitted += 1 + sum(accepted) / rows
    return emitted


def test_until_a_multi_token_forward_is_timed_at_these_rows_the_first_full_step_is_k_1():
    """The prior of an untimed shape is a guess, so the cheapest goes first."""
    c = SpeculationController(4)
    for _ in range(2):
        c.observe(0, [], [], 32, verify_s=0.05, draft_s=None)
    observe_acceptance(c, 0.9, rows=1, steps=20, k=4)  # acceptance seen elsewhere; verify timed at 1 row only
    assert c.choose(32) == 1
    c.cost.observe(32, 2, 0.055)  # that step, timed: cheap, so longer drafts are worth it
    assert c.choose(32) > 1
    assert c.choose(1) > 1  # timed at 1 row already (there probes verify whole rows)


def test_a_forward_whose_rows_ran_different_token_counts_is_priced_by_its_mean():
    """Rows with and without drafts: their forward's time keys the cost model at its mean tokens per row, so what
    speculative steps really cost stays measured (whole shapes alone left one early 2-token timing in charge)."""
    c = SpeculationController(4)
    for _ in range(2):
        c.observe(0, [], [], 8, verify_s=0.040, draft_s=None)
    c.observe(4, [8, 2, 1, 1], [2, 1, 1, 0], 8, verify_s=0.060, draft_s=0.001, fed=20)  # 20 tokens: 2.5 per row
    assert c.cost.verify_timed(8)
    assert abs(c.cost(8, 2.5) - 0.060) < 1e-12
    assert abs(c.cost(8, 1.75) - 0.050) < 1e-12  # halfway to the decode step
    assert abs(c.cost(8, 4.0) - 0.040 * (1 + 0.5 * 3 / 1.5)) < 1e-12  # past it: extended through (1, 1)
    for fed in (21, 22):  # 2.625 and 2.75 tokens a row: keys to a quarter token, so they stay few
        c.observe(4, [8, 2, 1, 1], [2, 1, 1, 0], 8, verify_s=0.060, draft_s=0.001, fed=fed)
    assert sorted(c.cost.points) == [1, 2.5, 2.75]


def test_probes_that_cost_a_decode_step_come_once_in_fifty_steps_off_even_at_the_start_of_a_call():
    c = controller_with_costs(decode_s=0.05, extra_per_token=1.0, rows=32)  # speculation never pays here
    observe_acceptance(c, 0.3, rows=32, steps=4, k=1)
    c.observe_probe(32, 0.10)  # a probe took two decode steps' time
    assert c.probe_wait(32) == (0.10 / 0.05 - 1) / c.probe_budget == 50
    probes = []
    for call in range(6):  # 48-step calls
        c.new_batch(32)
        for step in range(48):
            k = c.choose(32)
            if c.probing:
                probes.append(48 * call + step)
                c.observe_probe(32, 0.10)
            c.observe(k, [32] * k, [0] * k, 32, verify_s=0.05, draft_s=None)
    assert len(probes) >= 4 and min(b - a for a, b in zip(probes[:-1], probes[1:], strict=True)) >= 50, probes
    cheap = controller_with_costs(decode_s=0.05, extra_per_token=1.0, rows=32)
    observe_acceptance(cheap, 0.3, rows=32, steps=4, k=1)
    cheap.new_batch(32)
    assert cheap.choose(32) == cheap.probe_k and cheap.probing  # probe cost unmeasured: each call starts with one


def test_k_is_zero_when_verification_costs_more_than_it_saves():
    c = controller_with_costs(decode_s=0.01, extra_per_token=1.0)  # each extra token costs a whole decode step
    observe_acceptance(c, 0.6, rows=1, steps=20, k=4)
    assert c.choose(1) == 0


def test_k_is_positive_when_verification_is_cheap():
    c = controller_with_costs(decode_s=0.01, extra_per_token=0.02)
    observe_acceptance(c, 0.6, rows=1, steps=20, k=4)
    assert c.choose(1) > 0


def test_a_useless_draft_is_turned_off_within_two_steps_and_probed_rarely():
    c = SpeculationController(4)
    for _ in range(2):  # nothing trusted yet: decode plainly, which times a decode step (twice: warm-up)
        assert c.choose(8) == 0
        c.observe(0, [], [], 8, verify_s=0.010, draft_s=None)
    on = []
    for _ in range(100):
        k = c.choose(8)
        on.append(k)
        reached = [8] + [0] * (k - 1) if k else []
        c.observe(k, reached, [0] * k, 8, verify_s=0.010 * (1 + 0.1 * k), draft_s=0.001 * k)
    assert sum(1 for k in on[2:] if k) <= 5, on  # probes at 8, 16, 32, 64 steps off
    assert set(on[2:]) <= {0, c.probe_k}  # nothing but probes


def test_a_draft_that_got_better_is_noticed_by_a_probe():
    c = controller_with_costs(decode_s=0.01, extra_per_token=0.05, rows=1)
    observe_acceptance(c, 0.0, rows=1, steps=5, k=1)
    assert c.choose(1) == 0
    chosen = []
    for _ in range(80):
        k = c.choose(1)
        chosen.append(k)
        if k:
            observe_acceptance(c, 0.9, rows=1, steps=1, k=k)
        else:
            c.observe(0, [], [], 1, verify_s=0.01, draft_s=None)
    assert sum(k > 0 for k in chosen[-10:]) >= 9, chosen  # on again, but for a plain step that re-times decode


def test_cost_model_keys_on_rows_and_tokens_not_their_product():
    cost = VerifyCostModel()
    cost.observe(1, 8, 0.020)
    cost.observe(8, 1, 0.030)
    cost.observe(1, 1, 0.018)
    assert cost(1, 8) == 0.020 and cost(8, 1) == 0.030
    # an unobserved shape: the decode cost at those rows times the verify/decode ratio of the nearest rows
    assert abs(cost(8, 8) - 0.030 * 0.020 / 0.018) < 1e-12
    assert abs(cost(4, 1) - (0.018 + (0.030 - 0.018) * 3 / 7)) < 1e-12


def test_a_shapes_first_timing_is_replaced_by_its_second_and_one_slow_forward_does_not_price_it():
    cost = VerifyCostModel(window=5)
    cost.observe(4, 1, 0.050)  # the first call of a shape pays one-off costs
    cost.observe(4, 1, 0.040)
    assert cost(4, 1) == 0.040
    cost.observe(4, 1, 0.044)
    assert abs(cost(4, 1) - 0.042) < 1e-12  # median of two: their mean
    cost.observe(4, 1, 0.200)  # a stall
    assert cost(4, 1) == 0.044
    for seconds in (0.030, 0.030, 0.030):  # the machine got faster: the window follows within a few forwards
        cost.observe(4, 1, seconds)
    assert cost(4, 1) == 0.030


def test_decoding_stays_plain_until_a_decode_step_was_timed_twice():
    c = SpeculationController(4)
    assert c.choose(1) == 0
    c.observe(0, [], [], 1, verify_s=0.010, draft_s=None)
    assert c.choose(1) == 0 and not c.cost.known()
    c.observe(0, [], [], 1, verify_s=0.010, draft_s=None)
    assert c.cost.known()


def test_a_proposal_that_absorbed_a_backlog_does_not_set_the_draft_cost():
    c = controller_with_costs(decode_s=0.01, extra_per_token=0.05)
    c.observe(2, [1, 1], [1, 0], 1, verify_s=0.0105, draft_s=None)  # e.g. a probe after 64 steps off
    assert c.draft_cost(2, 1) == c.draft_prior * 2 * 0.01  # none timed yet: the prior share of a decode step
    c.observe(2, [1, 1], [1, 0], 1, verify_s=0.0105, draft_s=0.002)
    assert c.draft_cost(2, 1) == 0.002


def test_while_speculating_a_plain_step_re_times_decode_at_each_row_count():
    c = controller_with_costs(decode_s=0.01, extra_per_token=0.02, rows=4)
    observe_acceptance(c, 0.8, rows=1, steps=1, k=1)  # acceptance seen (at another row count): no probe first
    chosen = []
    for _ in range(70):
        k = c.choose(4)
        chosen.append(k)
        observe_acceptance(c, 0.8, rows=4, steps=1, k=k) if k else c.observe(0, [], [], 4, 0.01, None)
    plain = [i for i, k in enumerate(chosen) if k == 0]
    assert plain[0] == 0 and [b - a for a, b in zip(plain, plain[1:], strict=False)] == [33, 33], chosen
    assert c.choose(3) == 0  # a row count never decoded at is timed first


def test_a_probe_at_batch_1_drafts_max_k_and_prices_long_drafts_by_their_own_forward():
    """At batch 1 on a CPU a 2-token forward can cost what a 5-token one does (measured: 1.10 and 0.96 decode steps):
    a weak draft loses at k=1 there and pays at k=4. A probe of max_k times that shape and samples every position;
    one of a single draft left the controller pricing k=4 by the 2-token forward, and off."""
    def probed(probe_k: int | None) -> SpeculationController:
        c = SpeculationController(4, probe_k=probe_k)
        for _ in range(2):
            c.observe(0, [], [], 1, verify_s=0.010, draft_s=None)
        c.cost.observe(1, 2, 0.011)  # seen before: the 2-token forward, the dearest per token
        c.cost.observe(1, 2, 0.011)
        c.new_batch(1)
        k = c.choose(1)
        assert c.probing and k == c.probe_k
        c.observe(k, [1] + [0] * (k - 1), [0] * k, 1, verify_s=0.0096 if k == 4 else 0.011, draft_s=0.0001 * k)
        return c

    assert probed(None).probe_k == 4
    assert probed(None).choose(1) == 4  # the 5-token forward's own cost: a rejected probe still leaves k=4 paying
    assert probed(1).choose(1) == 0  # priced by the 2-token forward: off


def test_a_new_batch_probes_a_controller_that_is_off():
    c = controller_with_costs(decode_s=0.01, extra_per_token=0.05, rows=1)
    observe_acceptance(c, 0.0, rows=1, steps=5, k=1)
    assert c.choose(1) == 0
    c.new_batch(1)
    assert c.choose(1) == c.probe_k


def steps_until_off(c: SpeculationController, rows: int, rate: float, k: int, limit: int = 60) -> int:
    """Steps at acceptance `rate` after which no k is predicted to beat plain decoding by min_gain."""
    for steps in range(1, limit + 1):
        observe_acceptance(c, rate, rows=rows, steps=1, k=k)
        plain = c.tokens_per_second(rows, 0)
        if all(c.tokens_per_second(rows, j) < (1 + c.min_gain) * plain for j in range(1, c.max_k + 1)):
            return steps
    return limit + 1


def test_when_acceptance_collapses_at_batch_8_speculation_stops_within_a_few_steps():
    """Rows that move past their answers into text the draft does not predict: the estimate follows the last
    few steps' rows, not a history of the answers (a per-step decay of 0.98 kept it on for ~50 steps)."""
    c = controller_with_costs(decode_s=0.01, extra_per_token=0.1, rows=8)
    observe_acceptance(c, 0.9, rows=8, steps=20, k=4)
    assert c.choose(8) > 0
    assert steps_until_off(c, rows=8, rate=0.0, k=4) <= 6
    slow = controller_with_costs(decode_s=0.01, extra_per_token=0.1, rows=8)
    slow.memory = 1e9  # a plain average over all history: the same collapse is not noticed for long
    observe_acceptance(slow, 0.9, rows=8, steps=20, k=4)
    assert steps_until_off(slow, rows=8, rate=0.0, k=4) > 12


def next_choice(c: SpeculationController, rows: int) -> int:
    """The next step's k, past a plain step that only re-times decode."""
    k = c.choose(rows)
    if not k and not c.steps_off:
        c.observe(0, [], [], rows, verify_s=c.cost(rows, 1), draft_s=None)
        k = c.choose(rows)
    return k


def speculative_steps(c: SpeculationController, rows: int, rate: float, steps: int) -> int:
    """One call of `steps` steps at acceptance `rate` (every position): how many were speculative, probes aside."""
    c.new_batch(rows)
    on = 0
    for _ in range(steps):
        k = c.choose(rows)
        if k:
            on += not c.probing
            observe_acceptance(c, rate, rows=rows, steps=1, k=k)
        else:
            c.observe(0, [], [], rows, verify_s=c.cost(rows, 1), draft_s=None)
    return on


def test_a_call_after_one_that_ended_off_starts_from_that_calls_whole_acceptance():
    """A call's last steps are its hardest text (rows past their answers). An estimate frozen there kept batch 4
    off into the next call's fresh answers until a probe was due; after a call that ended off, the next starts
    from the acceptance of all of that call's steps."""
    c = controller_with_costs(decode_s=0.01, extra_per_token=0.05, rows=4)
    c.new_batch(4)
    observe_acceptance(c, 0.7, rows=4, steps=30, k=2)  # answers the draft predicts
    assert next_choice(c, 4) > 0
    assert steps_until_off(c, rows=4, rate=0.0, k=2) <= 16  # past them, within the call
    assert c.choose(4) == 0 and not c.probing
    c.new_batch(4)
    assert next_choice(c, 4) > 0 and not c.off  # speculating from the first steps of the new call

    on = controller_with_costs(decode_s=0.01, extra_per_token=0.05, rows=4)
    observe_acceptance(on, 0.9, rows=4, steps=60, k=2)
    observe_acceptance(on, 0.6, rows=4, steps=10, k=2)
    assert next_choice(on, 4) > 0 and not on.off
    before = on.accept
    on.new_batch(4)
    assert on.accept == before  # a call that ended speculating: its estimate stands (positions k never reaches too)


def test_a_draft_that_stops_being_accepted_is_not_revived_at_each_call():
    """Verification as cheap as decoding, so any acceptance pays: after good calls the draft accepts nothing.
    The call it died in speculates until its estimate falls; the calls after it start from that call's
    average and stay off (probes aside)."""
    c = controller_with_costs(decode_s=0.01, extra_per_token=0.0, rows=4)
    assert speculative_steps(c, 4, rate=0.8, steps=48) > 40
    died_in = speculative_steps(c, 4, rate=0.0, steps=48)
    assert 0 < died_in <= 16
    assert [speculative_steps(c, 4, rate=0.0, steps=48) for _ in range(4)] == [0, 0, 0, 0]


def test_only_a_probe_is_marked_as_probing():
    c = SpeculationController(4)
    for _ in range(2):
        c.choose(8)
        c.observe(0, [], [], 8, verify_s=0.010, draft_s=None)
    marks = []
    for _ in range(40):
        k = c.choose(8)
        marks.append((k, c.probing))
        c.observe(k, [8] + [0] * (k - 1) if k else [], [0] * k, 8, verify_s=0.010 * (1 + 0.1 * k), draft_s=0.001 * k)
    assert any(probing for _, probing in marks)
    assert all(probing == (k > 0) for k, probing in marks[1:]), marks  # once off, every k > 0 is a probe


def test_a_fresh_controller_tests_its_prior_with_a_probe_then_follows_what_it_saw():
    c = controller_with_costs(decode_s=0.01, extra_per_token=0.02, rows=8)  # cheap verification: the prior says on
    k = c.choose(8)
    assert k == c.probe_k == c.max_k and c.probing
    n = c.probe_rows  # of the 8 rows, the probe verified n rows' drafts (a ragged forward of 8 + n * k tokens)
    c.observe(k, [n] * k, [n] * k, 8, verify_s=0.0105, draft_s=0.001, fed=8 + n * k)
    assert c.choose(8) > 1 and not c.probing  # a good draft is on at once
    useless = controller_with_costs(decode_s=0.01, extra_per_token=0.02, rows=8)
    assert useless.choose(8) == useless.probe_k
    useless.observe(k, [n] + [0] * (k - 1), [0] * k, 8, verify_s=0.0105, draft_s=0.001, fed=8 + n * k)
    # off; the probe counted as the new call's probe, so the next comes an interval later
    assert [useless.choose(8) for _ in range(15)] == [0] * 15


def test_a_probe_does_not_teach_how_many_drafts_a_full_step_verifies():
    """A probe drafts on its first probe_rows rows only: its forward's few drafts per row say nothing of a step of
    k's, and learned from, made every k look nearly free at batch 32."""
    c = controller_with_costs(decode_s=0.1, extra_per_token=0.5, rows=32, max_k=7)
    observe_acceptance(c, 0.3, rows=32, steps=3, k=7)  # full steps: 7 drafts per row verified
    assert c.verified_drafts(1) == pytest.approx(1)
    c.probing = True
    n = c.probe_rows
    c.observe(7, [n] * 7, [n] * 7, 32, verify_s=0.2, draft_s=0.01, fed=32 + n * 7)
    assert c.verified_drafts(1) == pytest.approx(1) and c.verified_drafts(7) == pytest.approx(7)
    assert c.cost.points[round(4 * (32 + n * 7) / 32) / 4][32] == pytest.approx(0.2)  # its forward is still timed
    one = controller_with_costs(decode_s=0.03, extra_per_token=0.1, rows=1, max_k=7)  # a probe of every row: a step
    one.probing = True
    one.observe(7, [1] * 3 + [0] * 4, [1] * 2 + [0] * 5, 1, verify_s=0.05, draft_s=0.01, fed=4)  # verified 3 drafts
    assert one.verified_drafts(7) == pytest.approx(3)


def simulated_tail(accept: list[float], k: int, rows: int, tokens: int, trials: int, seed: int = 0) -> float:
    """Steps until the last of `rows` rows has `tokens` tokens / the rows' mean steps, drafts accepted at random."""
    rng = random.Random(seed)
    ratios = []
    for _ in range(trials):
        steps = []
        for _ in range(rows):
            made = n = 0
            while made < tokens:
                made += 1 + next((i for i, a in enumerate(accept[:k]) if rng.random() >= a), k)
                n += 1
            steps.append(n)
        ratios.append(max(steps) / (sum(steps) / rows))
    return sum(ratios) / trials


def test_the_tail_is_how_much_longer_the_last_row_takes_than_the_mean():
    """Rows accept by chance, and a batch decodes until its last row is done: at batch 8 and 47 tokens that
    costs 8-14% more steps than the rows' mean, as much as a step's whole predicted gain at batch 8 here."""
    accept = [0.67, 0.47, 0.23, 0.11]
    c = SpeculationController(4)
    c.hits, c.trials = [a * 1e6 for a in accept], [1e6] * 4
    for rows in (4, 8, 32):
        for k in (1, 3):
            assert abs(c.tail(k, [47] * rows) - simulated_tail(accept, k, rows, 47, trials=300)) < 0.02, (rows, k)
    assert c.tail(2, [47]) == 1.0 and c.tail(0, [47] * 8) == 1.0 and c.tail(2, None) == 1.0
    assert c.tail(2, [47] + [20] * 7) == 1.0  # one row far behind the others: it alone sets the pace


def test_a_batch_speculates_only_where_the_gain_outlasts_its_last_row():
    """Per step, k drafts pay ~10% at batch 8; the batch's last row, by chance the slowest, eats it."""
    c = controller_with_costs(decode_s=0.01, extra_per_token=0.25, rows=8)
    for _ in range(2):
        c.observe(0, [], [], 1, verify_s=0.01, draft_s=None)
    c.cost.observe(1, 5, 0.0125)  # batch 1: its one row sets its own pace
    observe_acceptance(c, 0.5, rows=8, steps=20, k=4)
    assert c.choose(8) > 0  # by the rows' mean
    assert c.choose(8, [47] * 8) == 0
    assert c.choose(1, [47]) > 0


def test_with_draft_stops_a_step_is_on_at_max_k_or_off():
    """Where the draft's confidence ends each proposal, the controller picks only whether to speculate: k is the
    most a proposal may draft. Off at a useless draft, max_k (not the best fixed k) at a good one."""
    def chosen(rate: float, stops_early: bool) -> int:
        c = controller_with_costs(decode_s=0.01, extra_per_token=0.05)
        c.new_batch(1, stops_early=stops_early)
        observe_acceptance(c, rate, rows=1, steps=40, k=4)
        c.observe(0, [], [], 1, verify_s=0.01, draft_s=None)  # the refresh's plain step
        k = c.choose(1)
        return -1 if c.probing else k  # a call's first step probes a controller that is off

    assert chosen(0.9, True) == 4 and chosen(0.0, True) == -1
    # the first draft always accepted, the second never: one k per step picks k = 1 (a sampled call, a block drafter)
    assert chosen(0.7, True) == 4 and chosen(0.7, False) == 1


def test_the_stop_rule_prices_a_draft_position_by_its_measured_cost():
    """min_accepted = rows x (a draft position's seconds + a verified token per row's) / a decode step's seconds; the
    position's seconds come from the rule's own timing once a step observed it, else draft_prior decode steps."""
    c = controller_with_costs(decode_s=0.01, extra_per_token=0.05, rows=2)
    c.verified[4] = 4.0
    rule = c.stop_rule(2, 4)
    assert abs(rule.min_accepted - 2 * (0.05 + 0.05)) < 1e-9
    rule.position_s[:] = [0.002, 0.002]
    c.observe(4, [2, 1, 0, 0], [1, 0, 0, 0], 2, verify_s=c.cost(2, 5), draft_s=0.005)
    assert c.position_s[2] == 0.002 and c.stop is None
    assert abs(c.stop_rule(2, 4).min_accepted - 2 * (0.2 + 0.05)) < 1e-9
    c.probing = True
    assert c.stop_rule(2, 4) is None  # a probe samples every position
    c.probing = False
    assert c.stop_rule(2, 1) is None and SpeculationController(4, draft_stop=False).stop_rule(1, 4) is None


def test_a_row_count_never_probed_at_waits_as_long_as_the_nearest_one_that_was():
    """Rows leave a batch one by one: a probe at 31 rows is priced by what one at 32 cost, not free."""
    c = controller_with_costs(decode_s=0.05, extra_per_token=1.0, rows=32)
    assert c.probe_wait(31) == 0  # nothing probed yet: the first probe is free to come
    c.observe_probe(32, 0.10)
    assert c.probe_wait(31) == c.probe_wait(32) == 50
    c.observe_probe(8, 0.06)
    assert c.probe_wait(9) == c.probe_wait(8) == pytest.approx(0.2 / c.probe_budget)


def test_while_on_at_a_short_k_a_probe_now_and_then_reads_the_positions_past_it():
    """A step of k never reaches the positions past k: one rejected draft at position 2 held its estimate at 0.15 and
    a batch-1 bench run at T=1 at k = 1 for 115 of 121 steps where fixed k = 7 ran 1.57x (stop 62)."""
    c = controller_with_costs(decode_s=0.01, extra_per_token=0.05, rows=1, max_k=4)
    c.observe(4, [1, 1, 0, 0], [1, 0, 0, 0], 1, verify_s=c.cost(1, 5), draft_s=0.002)  # position 2 rejected once
    chosen = []
    for _ in range(2 * c.refresh_every):
        k = c.choose(1)
        chosen.append((k, c.probing))
        if k:  # the draft is good at every position
            observe_acceptance(c, 0.95, rows=1, steps=1, k=k)
        else:
            c.observe(0, [], [], 1, verify_s=0.01, draft_s=None)
    assert chosen[0] == (1, False)  # the one rejection prices k > 1 out
    probe = chosen.index((4, True))
    assert probe <= c.refresh_every + 1 and all(k == 1 for k, _ in chosen[1:probe] if k)
    after = [k for k, _ in chosen[probe + 1:] if k]
    assert min(after) >= 3 and after[-1] == 4, chosen  # read once, the deeper positions pay
