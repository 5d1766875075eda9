import json
import logging
import re
import sys
import time

import pytest
import yaml

from codraft.config import Config, load_config
from codraft.observability import MetricsLogger, prepare_run_dir, progress, setup_logging


@pytest.fixture
def restore_logging():
    """setup_logging changes global state; put it back so other tests see the logging they expect."""
    root, ours = logging.getLogger(), logging.getLogger("codraft")
    handlers, levels = root.handlers[:], (root.level, ours.level)
    yield
    root.handlers[:] = handlers
    root.setLevel(levels[0])
    ours.setLevel(levels[1])


def lines(text: str) -> list[str]:
    return [line for line in re.split(r"[\r\n]", text) if line.strip()]


def test_setup_logging_level_and_idempotent(restore_logging, capsys):
    setup_logging("info")
    setup_logging("debug")
    logging.getLogger("codraft.test").debug("hello %d", 1)
    logging.getLogger("somelib").info("library chatter")
    err = capsys.readouterr().err
    assert len(lines(err)) == 1 and re.fullmatch(r"\d\d:\d\d:\d\d DEBUG codraft\.test: hello 1\n", err)
    setup_logging("warning")
    logging.getLogger("codraft.test").info("quiet")
    assert capsys.readouterr().err == ""


def test_log_line_during_progress_bar_is_its_own_line(restore_logging, capsys):
    setup_logging("info")
    for i in progress(range(3), "work", force=True):
        if i == 1:
            logging.getLogger("codraft.test").info("midway")
    assert any(line.endswith("INFO codraft.test: midway") for line in lines(capsys.readouterr().err))


def test_without_a_tty_a_short_bar_is_silent_unless_forced(restore_logging, capsys):
    assert not sys.stderr.isatty()
    setup_logging("info")
    assert list(progress([1, 2], "items")) == [1, 2]
    with progress(5, "steps") as bar:
        bar.update(5)
    assert capsys.readouterr().err == ""
    with progress(5, "steps", force=True) as bar:
        bar.update(5)
    assert "steps: 100%" in capsys.readouterr().err


def test_without_a_tty_a_long_bar_logs_its_state_as_lines(restore_logging, capsys, monkeypatch):
    monkeypatch.setattr("codraft.observability.PROGRESS_LOG_EVERY_S", 0.05)
    setup_logging("info")
    bar = progress(range(4), "distil")
    for i in bar:
        time.sleep(0.06)
        bar.set_postfix({"loss": i})  # shown with the next timed line, not a line of its own
    logged = [line for line in lines(capsys.readouterr().err) if "codraft.observability: distil:" in line]
    assert 1 <= len(logged) <= 4 and logged[-1].endswith("distil: 100% 4/4 [00:00<00:00], loss=3"), logged
    assert "\r" not in "".join(logged) and len(logged) == len(set(logged))  # one line per state, no repeats


def test_prepare_run_dir_resolves_dir_and_saves_config(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    cfg = load_config(None, ["model.path=tiny-llama", "generate.top_k=7"])
    run_dir = prepare_run_dir(cfg, "generate")
    assert re.fullmatch(r"runs/generate-\d{8}-\d{6}", str(run_dir)) and run_dir.is_dir()
    assert cfg.run.dir == str(run_dir)
    saved = load_config(run_dir / "config.yaml", [])
    assert saved == cfg and saved.generate.top_k == 7

    again = load_config(None, ["model.path=tiny-llama"])
    monkeypatch.setattr("time.strftime", lambda fmt: run_dir.name.removeprefix("generate-"))
    assert prepare_run_dir(again, "generate") == run_dir.with_name(run_dir.name + "-1")


def test_prepare_run_dir_uses_explicit_dir(tmp_path):
    cfg = Config()
    cfg.run.dir = str(tmp_path / "a" / "b")
    assert prepare_run_dir(cfg, "train") == tmp_path / "a" / "b"
    assert yaml.safe_load((tmp_path / "a" / "b" / "config.yaml").read_text())["run"]["dir"] == cfg.run.dir


def test_metrics_jsonl_round_trip(tmp_path, caplog):
    with MetricsLogger(tmp_path, tensorboard=False) as metrics:
        metrics.log(1, {"loss/policy": 0.5, "reward/mean": 1})
        metrics.log(2, {"loss/policy": float("nan"), "grad_norm/draft": float("inf")})
        metrics.log(3, {"loss/policy": float("nan")})
        # flushed per line: readable while the run is still going
        rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows == [
        {"step": 1, "loss/policy": 0.5, "reward/mean": 1.0},
        {"step": 2, "loss/policy": None, "grad_norm/draft": None},
        {"step": 3, "loss/policy": None},
    ]
    assert all(next(iter(row)) == "step" for row in rows)
    assert metrics.non_finite == {"loss/policy": 2, "grad_norm/draft": 1}
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 3  # once per metric name, then a summary at close
    assert "loss/policy is nan at step 2" in warnings[0] and "3 non-finite" in warnings[2]


def test_metrics_append_to_existing_file(tmp_path):
    for step in (1, 2):
        with MetricsLogger(tmp_path, tensorboard=False) as metrics:
            metrics.log(step, {"x": step})
    assert [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").open()] == [1, 2]


def test_tensorboard_event_file_written(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with MetricsLogger(tmp_path) as metrics:
        for step in range(3):
            metrics.log(step, {"loss/draft": 1.0 / (step + 1), "spec/acceptance_length": float("nan")})
    assert list(tmp_path.glob("events.out.tfevents.*"))
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    assert events.Tags()["scalars"] == ["loss/draft"]  # the null values are not mirrored
    assert [(e.step, round(e.value, 4)) for e in events.Scalars("loss/draft")] == [(0, 1.0), (1, 0.5), (2, 0.3333)]


def test_missing_tensorboard_warns_and_continues(tmp_path, monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # import now raises ImportError
    with MetricsLogger(tmp_path) as metrics:
        metrics.log(0, {"x": 1.0})
    assert "TensorBoard unavailable" in caplog.text
    assert json.loads((tmp_path / "metrics.jsonl").read_text()) == {"step": 0, "x": 1.0}


def test_a_resumed_run_drops_the_rows_after_its_checkpoint_step(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "a": 1.0}\n{"step": 2, "a": 2.0}\n{"step": 3, "a": 3.0}\n{"step": 4, "a"')  # torn
    with MetricsLogger(tmp_path, tensorboard=False, resume_step=2) as metrics:
        metrics.log(3, {"a": 30.0})
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert rows == [{"step": 1, "a": 1.0}, {"step": 2, "a": 2.0}, {"step": 3, "a": 30.0}]
    assert not list(tmp_path.glob(".*.tmp"))


def test_under_torchrun_only_rank_0_logs_info_and_shows_progress(restore_logging, capsys, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    setup_logging("info")
    log = logging.getLogger("codraft.test")
    log.info("step 1/2")
    log.warning("a rank's own trouble")
    assert re.fullmatch(r"\d\d:\d\d:\d\d WARNING \[rank 1\] codraft\.test: a rank's own trouble\n",
                        capsys.readouterr().err)
    assert progress(3, "train", force=True).disable
    monkeypatch.setenv("RANK", "0")
    setup_logging("info")
    log.info("step 1/2")
    assert capsys.readouterr().err.endswith("INFO [rank 0] codraft.test: step 1/2\n")
    assert not progress(3, "train", force=True).disable
