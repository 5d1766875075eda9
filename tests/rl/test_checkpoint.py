import pytest
import torch

import codraft.rl.checkpoint as checkpoint
from codraft.rl.checkpoint import load_checkpoint, save_checkpoint


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
