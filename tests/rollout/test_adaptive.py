"""The speculation controller: k from acceptance and measured cost, cheap to learn, off when it does not pay."""

from codraft.rollout.adaptive import SpeculationController, VerifyCostModel


def controller_with_costs(decode_s: float, extra_per_token: float, rows: int = 1, max_k: int = 4):
    """A controller whose cost model observed a decode step and a (max_k + 1)-token verify at `rows`."""
    c = SpeculationController(max_k)
    c.cost.observe(rows, 1, decode_s)
    c.cost.observe(rows, max_k + 1, decode_s * (1 + extra_per_token * max_k))
    return c


def observe_acceptance(c: SpeculationController, rate: float, rows: int, steps: int, k: int) -> None:
    for _ in range(steps):
        reached, accepted, alive = [], [], float(rows)
        for _ in range(k):
            reached.append(round(alive))
            alive *= rate
            accepted.append(round(alive))
        c.observe(k, reached, accepted, rows, verify_s=c.cost(rows, k + 1), draft_s=0.001 * k)


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
    assert c.choose(8) == 0  # nothing measured yet: decode plainly, which times a decode step
    c.observe(0, [], [], 8, verify_s=0.010, draft_s=0.0)
    on = []
    for _ in range(100):
        k = c.choose(8)
        on.append(k)
        reached = [8] + [0] * (k - 1) if k else []
        c.observe(k, reached, [0] * k, 8, verify_s=0.010 * (1 + 0.1 * k), draft_s=0.001 * k)
    assert sum(1 for k in on[2:] if k) <= 5, on  # probes at 8, 16, 32, 64 steps off
    assert all(k <= 1 for k in on[2:])


def test_a_draft_that_got_better_is_noticed_by_a_probe():
    c = controller_with_costs(decode_s=0.01, extra_per_token=0.05, rows=1)
    observe_acceptance(c, 0.0, rows=1, steps=5, k=1)
    assert c.choose(1) == 0
    for _ in range(80):
        k = c.choose(1)
        if k:
            observe_acceptance(c, 0.9, rows=1, steps=1, k=k)
    assert c.choose(1) > 0


def test_cost_model_keys_on_rows_and_tokens_not_their_product():
    cost = VerifyCostModel()
    cost.observe(1, 8, 0.020)
    cost.observe(8, 1, 0.030)
    cost.observe(1, 1, 0.018)
    assert cost(1, 8) == 0.020 and cost(8, 1) == 0.030
    # an unobserved shape: the decode cost at those rows times the verify/decode ratio of the nearest rows
    assert abs(cost(8, 8) - 0.030 * 0.020 / 0.018) < 1e-12
    assert abs(cost(4, 1) - (0.018 + (0.030 - 0.018) * 3 / 7)) < 1e-12
