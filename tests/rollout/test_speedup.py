"""The measured rollout speedup (rollout/speedup.py): plain decoding of the same rows to the same lengths,
a ratio of two timings and nothing else, wired into the trainer without changing its training."""

import pytest
import torch

from codraft.config import load_config
from codraft.rollout import generate
from codraft.rollout import speedup as speedup_module
from codraft.rollout.drafters import NgramDrafter
from codraft.rollout.speedup import measured_speedup, plain_like
from codraft.train.trainer import Trainer
from tests.rollout.conftest import tiny_model
from tests.train.test_trainer import TINY, deterministic

PROMPTS = [[3, 4, 5, 3, 4, 5], [7, 8, 9, 7], [2, 11, 2, 11, 2]]


def test_plain_like_decodes_every_row_to_the_rollout_s_length_and_greedy_gives_its_tokens():
    model = tiny_model(sharpen=4.0)
    spec = generate(model, PROMPTS, drafter=NgramDrafter(), num_speculative_tokens=3, temperature=0.0,
                    max_new_tokens=[5, 12, 9], stop_token_ids=[6], seed=0)  # some rows may stop early on 6
    plain = plain_like(model, spec, temperature=0.0)
    assert [len(t) for t in plain.tokens] == [len(t) for t in spec.tokens]
    assert plain.tokens == spec.tokens  # lossless greedy speculation: the same tokens, the same work
    assert plain.stats.draft_tokens_proposed == 0


def test_the_measured_speedup_is_the_ratio_of_the_two_timings_and_nothing_else(monkeypatch):
    clock = iter([100.0, 103.0])  # the plain run: 3 s
    monkeypatch.setattr(speedup_module.time, "perf_counter", lambda: next(clock))
    monkeypatch.setattr(speedup_module, "plain_like", lambda *a, **k: None)
    out = measured_speedup(None, None, 2.0, temperature=1.0)
    assert out == {"rollout/spec_s": 2.0, "rollout/plain_s": 3.0, "rollout/speedup_measured": 1.5}


def test_trainer_measures_every_n_steps_without_changing_the_training(tmp_path):
    def run(every: int) -> tuple[list[dict], dict]:
        cfg = load_config(None, [*TINY, "draft.family=eagle3", f"rl.measure_speedup_every={every}",
                                 "rl.drift_every=0", f"run.dir={tmp_path / str(every)}"])
        trainer = Trainer(cfg, tmp_path / str(every))
        return [trainer.train_step() for _ in range(4)], trainer.policy.state_dict()

    (off, off_weights), (every2, weights2) = run(0), run(2)
    assert not any("rollout/speedup_measured" in m for m in off)
    assert ["rollout/speedup_measured" in m for m in every2] == [False, True, False, True]  # steps 2 and 4
    for m in every2[1], every2[3]:
        assert m["rollout/speedup_measured"] == m["rollout/plain_s"] / m["rollout/spec_s"]
        assert 0 < m["rollout/spec_s"] <= m["time/rollout_s"] <= m["time/step_s"]
    assert all(torch.equal(off_weights[k], weights2[k]) for k in off_weights)  # measuring does not perturb training
    for a, b in zip(off, every2, strict=True):
        assert deterministic(a) == pytest.approx(deterministic(b), rel=0, abs=0, nan_ok=True)


def test_no_measurement_without_a_draft(tmp_path):
    cfg = load_config(None, [*TINY, "draft.family=none", "rl.measure_speedup_every=1", "rl.drift_every=0",
                             f"run.dir={tmp_path}"])
    assert "rollout/speedup_measured" not in Trainer(cfg, tmp_path).train_step()
