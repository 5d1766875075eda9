"""SIGINT / SIGTERM during `codraft train`: the step in flight finishes, its checkpoint is written, the summary is
printed and the run exits 130 / 143 without a traceback; `--resume` then continues from that step."""

import json
import os
import signal
import subprocess
import sys
import threading

import pytest

from codraft.cli import main
from tests.train.test_trainer import TINY, run_metrics


def train_until_first_step_then(signum: int, run_dir, *overrides: str) -> tuple[int, str]:
    """Run `codraft train` in a subprocess, send `signum` once its first step line is logged; (exit code, stderr)."""
    cmd = [sys.executable, "-m", "codraft", "train", *TINY, "rl.steps=200", f"run.dir={run_dir}", *overrides]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, env=os.environ | {"PYTHONUNBUFFERED": "1"})
    watchdog = threading.Timer(180, proc.kill)  # never hang the suite
    watchdog.start()
    lines = []
    try:
        for line in proc.stderr:
            lines.append(line)
            if "step 1/200" in line:
                proc.send_signal(signum)
        return proc.wait(), "".join(lines)
    finally:
        watchdog.cancel()
        proc.kill()


@pytest.mark.parametrize("signum, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)], ids=["SIGINT", "SIGTERM"])
def test_a_signal_checkpoints_the_last_step_prints_the_summary_and_resume_continues(tmp_path, signum, code):
    rc, err = train_until_first_step_then(signum, tmp_path)
    assert rc == code, err
    assert "Traceback" not in err
    assert "summary (first -> last 5 steps mean)" in err
    steps = [m["step"] for m in run_metrics(tmp_path)]
    last = steps[-1]
    assert steps == list(range(1, last + 1)) and last < 200
    assert (tmp_path / "checkpoints" / "latest").read_text() == f"step_{last:06d}"
    assert json.loads((tmp_path / "checkpoints" / f"step_{last:06d}" / "meta.json").read_text())["step"] == last
    assert f"stopped after step {last}; continue with: codraft train --resume {tmp_path}" in err
    assert main(["train", "--resume", str(tmp_path), f"rl.steps={last + 1}"]) == 0
    assert [m["step"] for m in run_metrics(tmp_path)] == list(range(1, last + 2))


def test_checkpoints_are_written_every_10_steps_by_default(tmp_path):
    assert main(["train", *TINY, "draft.family=none", "rl.steps=11", f"run.dir={tmp_path}"]) == 0
    assert sorted(p.name for p in (tmp_path / "checkpoints").glob("step_*")) == ["step_000010", "step_000011"]


def test_a_relaunched_pp2_run_speaks_with_one_voice_and_stops_cleanly_on_ctrl_c(tmp_path):
    """The relaunching parent forwards SIGINT to torchrun once; torchrun hands it to both ranks, which finish the
    same step and write one checkpoint. Only rank 0 logs step lines and the summary."""
    rc, err = train_until_first_step_then(signal.SIGINT, tmp_path, "draft.family=none", "parallel.pp=2")
    assert rc == 130, err
    last = run_metrics(tmp_path)[-1]["step"]
    assert (tmp_path / "checkpoints" / "latest").read_text() == f"step_{last:06d}"
    for step in range(1, last + 1):
        assert err.count(f"codraft.commands.train: step {step}/200 ") == 1, err
    assert err.count("summary (first -> last 5 steps mean)") == 1
    assert "[rank 1]" not in err.replace("[rank 1] codraft.interrupt: SIGINT", "")  # rank 1: its own warning only
    # neither a rank nor torchrun (whose SignalException, raised after it handed the signal on, parallel/torchrun.py
    # catches) prints a traceback
    assert "Traceback" not in err and "SignalException" not in err, err
