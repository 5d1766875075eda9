"""The end-of-run summary keeps the first and last SUMMARY_STEPS steps' metrics, not every step's."""

import math
import statistics

from codraft.commands.train import SUMMARY, SUMMARY_STEPS, speedup_line, summary_table


def _row(step: int) -> dict:
    return dict.fromkeys(SUMMARY, float(step))


def test_summary_means_the_first_and_last_five_steps_whatever_the_split():
    steps = [_row(s) for s in range(1, 8)]  # 7 steps: head 1-5, the deque holds 6-7
    table = summary_table(steps[:SUMMARY_STEPS], steps[SUMMARY_STEPS:])
    assert table.splitlines()[1].split() == ["reward/mean", "3.000", "5.000"]  # (1..5) and (3..7)
    short = summary_table(steps[:2], [])  # a run of 2 steps: both means over steps 1-2
    assert short.splitlines()[1].split() == ["reward/mean", "1.500", "1.500"]
    assert summary_table([], []) == "(no steps run)"


def test_the_speedup_line_weighs_each_measured_step_by_its_seconds_and_lists_every_step():
    """As `codraft bench e2e` reports it: a 10 s rollout that bought 2 s and a 1 s one that bought 1 s read 14/11."""
    line = speedup_line({10: (12.0, 10.0), 20: (2.0, 1.0)}, "rollout", "plain seconds over speculative seconds")
    assert line.startswith("rollout, measured (rl.measure_speedup_every): ")
    assert "1.27x (plain seconds over speculative seconds) over 2 steps" in line
    assert f"mean SE {statistics.stdev([1.2, 2.0]) / math.sqrt(2):.2g}, median 1.60x (10: 1.20x, 20: 2.00x)" in line
