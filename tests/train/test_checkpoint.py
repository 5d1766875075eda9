import logging

import pytest
import torch

import codraft.train.checkpoint as checkpoint
from codraft.train.checkpoint import load_checkpoint, save_checkpoint


def warnings(caplog) -> list:
    """The warnings logged (an earlier test may have left codraft logging at info)."""
    return [r for r in caplog.records if r.levelno >= logging.WARNING]


def save(run_dir, step, value, keep=2):
    return save_checkpoint(run_dir, step, tensors={"policy": {"w": torch.full((3,), float(value))}},
                           optimizers={"policy": {"state": {}, "param_groups": [{"lr": 0.1, "params": [0]}]}},
                           meta={"note": value}, keep=keep)


def test_round_trip_and_pruning(tmp_path):
    for step in (1, 2, 3):
        save(tmp_path, step, step)
    ckpt = load_checkpoint(tmp_path)
    assert ckpt["meta"]["step"] == 3 and torch.equal(ckpt["tensors"]["policy"]["w"], torch.full((3,), 3.0))
    assert ckpt["optimizers"]["policy"]["param_groups"][0]["lr"] == 0.1
    assert sorted(p.name for p in (tmp_path / "checkpoints").glob("step_*")) == ["step_000002", "step_000003"]


def test_a_crash_mid_write_leaves_the_previous_checkpoint_loadable(tmp_path, monkeypatch):
    save(tmp_path, 1, 1)

    def crash(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(checkpoint, "save_file", crash)
    with pytest.raises(OSError, match="disk full"):
        save(tmp_path, 2, 2)
    ckpt = load_checkpoint(tmp_path)
    assert ckpt["meta"]["step"] == 1 and torch.equal(ckpt["tensors"]["policy"]["w"], torch.ones(3))


def test_missing_checkpoint_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="no complete checkpoint"):
        load_checkpoint(tmp_path)


def test_a_truncated_newest_checkpoint_falls_back_with_one_warning(tmp_path, caplog):
    save(tmp_path, 1, 1)
    newest = save(tmp_path, 2, 2) / "policy.safetensors"
    size = newest.stat().st_size
    newest.write_bytes(newest.read_bytes()[: size // 2])
    with caplog.at_level("WARNING", logger="codraft.train.checkpoint"):
        ckpt = load_checkpoint(tmp_path)
    assert ckpt["meta"]["step"] == 1 and torch.equal(ckpt["tensors"]["policy"]["w"], torch.ones(3))
    (warning,) = warnings(caplog)
    assert f"step_000002 (policy.safetensors has {size // 2} of its {size} bytes)" in warning.getMessage()


def test_a_checkpoint_damaged_in_place_falls_back_naming_the_error(tmp_path, caplog):
    save(tmp_path, 1, 1)
    newest = save(tmp_path, 2, 2) / "policy.safetensors"
    newest.write_bytes(b"\xff" * newest.stat().st_size)  # the right size, garbage inside
    with caplog.at_level("WARNING", logger="codraft.train.checkpoint"):
        assert load_checkpoint(tmp_path)["meta"]["step"] == 1
    (warning,) = warnings(caplog)
    assert "step_000002 (SafetensorError: " in warning.getMessage()


def test_a_missing_latest_pointer_is_a_warning_not_an_error(tmp_path, caplog):
    save(tmp_path, 1, 1)
    (tmp_path / "checkpoints" / "latest").unlink()
    with caplog.at_level("WARNING", logger="codraft.train.checkpoint"):
        assert load_checkpoint(tmp_path)["meta"]["step"] == 1
    (warning,) = warnings(caplog)
    assert "skipped no 'latest' pointer" in warning.getMessage()


def test_no_complete_checkpoint_is_one_error_naming_what_was_skipped(tmp_path):
    path = save(tmp_path, 1, 1)
    (path / "draft.safetensors").write_bytes(b"")  # not in the listing: ignored
    (path / "policy.safetensors").unlink()
    (tmp_path / "checkpoints" / ".tmp-step_000002").mkdir()  # killed during its first checkpoint
    with pytest.raises(FileNotFoundError) as e:
        load_checkpoint(tmp_path)
    assert str(e.value) == (f"{tmp_path / 'checkpoints'} holds no complete checkpoint; skipped .tmp-step_000002 "
                            "(an unfinished write), step_000001 (policy.safetensors is missing)")
