"""`codraft bench soak`, short: 20 steps killed after step 12 (checkpoint 10) and resumed, against one process."""

import json

from codraft.cli import main
from tests.train.test_trainer import TINY


def test_soak_kills_and_resumes_a_run_that_then_equals_an_uninterrupted_one(tmp_path, capsys):
    code = main(["bench", "soak", *TINY, "bench.soak_steps=20", "checkpoint.every=10", f"bench.out_dir={tmp_path}",
                 f"run.dir={tmp_path / 'runs'}"])
    assert code == 0, capsys.readouterr().err
    result = json.loads((tmp_path / "soak.json").read_text())
    assert (result["killed_after_step"], result["resumed_from_step"]) == (12, 10)
    assert result["metrics_steps_once"] == {"interrupted": True, "uninterrupted": True}
    assert result["metrics_equal"] and result["steps_differing"] == []
    assert result["final_metrics"]["interrupted"] == result["final_metrics"]["uninterrupted"]
    assert result["final_metrics"]["interrupted"]["spec/draft_tokens"] > 0  # speculation was on
    assert all(mb > 0 for run in result["rss_mb"].values() for mb in run)
    assert result["rss_growth"] is not None
    killed = (tmp_path / "runs" / "interrupted.log").read_text()
    assert "dropped 2 rows after step 10" in killed  # the resume replaced the steps the kill had logged
    assert "| RSS growth, uninterrupted (goal < 5%) |" in (tmp_path / "soak.md").read_text()


def test_soak_needs_speculation_and_room_for_the_kill(tmp_path, capsys):
    assert main(["bench", "soak", *TINY, "draft.family=none", f"bench.out_dir={tmp_path}"]) == 2
    assert "bench soak runs with speculation on: draft.family must be" in capsys.readouterr().err
    short = ["checkpoint.every=10", "bench.soak_steps=12"]
    assert main(["bench", "soak", *TINY, *short, f"bench.out_dir={tmp_path}"]) == 2
    assert ("kills the run after step 12 (two past the first checkpoint at or past the midpoint, checkpoint.every=10)"
            ": bench.soak_steps=12 must be larger") in capsys.readouterr().err
