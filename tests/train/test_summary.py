"""The end-of-run summary keeps the first and last SUMMARY_STEPS steps' metrics, not every step's."""

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


def test_the_speedup_line_lists_every_measured_step_and_their_median():
    line = speedup_line({10: 0.9, 20: 1.3, 30: 1.1})
    assert "median 1.10x over 3 steps (10: 0.90x, 20: 1.30x, 30: 1.10x)" in line
