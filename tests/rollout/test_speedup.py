"""The measured rollout speedup (rollout/speedup.py): plain decoding of the same rows to the same lengths,
a ratio of two timings and nothing else, wired into the trainer without changing its training; and the step's
speedup over the same step without a draft, from the step's timed parts."""

import logging

import pytest
import torch

from codraft.cli import main
from codraft.config import load_config
from codraft.models import linear as linear_module
from codraft.rollout import Rollout, RolloutStats, generate
from codraft.rollout import speedup as speedup_module
from codraft.rollout.drafters import NgramDrafter
from codraft.rollout.speedup import measured_speedup, plain_like, step_speedup
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


def rollout_with(pack_policy_s: float) -> Rollout:
    return Rollout([], [], [], [], RolloutStats(time_pack_policy_s=pack_policy_s))


def test_the_measured_speedup_is_the_ratio_of_the_two_timings_and_nothing_else(monkeypatch):
    clock = iter([100.0, 103.0])  # the plain run: 3 s, 0.25 of them its own (no-op) packing check
    monkeypatch.setattr(speedup_module.time, "perf_counter", lambda: next(clock))
    monkeypatch.setattr(speedup_module, "plain_like", lambda *a, **k: rollout_with(0.25))
    out = measured_speedup(None, rollout_with(0.75), 2.0, temperature=1.0)  # the rollout re-packed for 0.75 s
    # the plain time is what a plain rollout at this step costs: its decoding plus the policy's re-pack
    assert out == {"rollout/spec_s": 2.0, "rollout/plain_s": 3.5, "rollout/policy_repack_s": 0.5,
                   "rollout/speedup_measured": 1.75}


def test_after_an_update_only_the_rollout_re_packs_the_policy_and_times_it_apart(monkeypatch):
    model = tiny_model(sharpen=4.0)
    generate(model, PROMPTS, max_new_tokens=2)  # packs the policy
    with torch.no_grad():  # an optimizer step: in place, so the packed copies go stale
        for p in model.parameters():
            p.add_(0.0)
    packs = []
    real_pack = linear_module._pack
    monkeypatch.setattr(linear_module, "_pack", lambda *a, **k: packs.append(1) or real_pack(*a, **k))
    spec = generate(model, PROMPTS, drafter=NgramDrafter(), num_speculative_tokens=3, temperature=1.0,
                    max_new_tokens=6, seed=0)
    repacked = len(packs)
    assert repacked > 0 and 0 < spec.stats.time_pack_policy_s <= spec.stats.time_pack_s
    out = measured_speedup(model, spec, 1.0, temperature=1.0, seed=0)
    assert len(packs) == repacked  # the plain run found the policy packed: the re-pack is charged from the rollout
    assert out["rollout/speedup_measured"] == out["rollout/plain_s"] / out["rollout/spec_s"]
    assert out["rollout/policy_repack_s"] <= spec.stats.time_pack_policy_s


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


def test_the_step_without_a_draft_swaps_the_rollout_for_plain_decoding_and_drops_the_draft_s_training():
    # a 10 s step: 4 s of speculative rollout, 0.5 s training the draft; plain decoding took 6 s
    assert step_speedup(10.0, 4.0, 6.0, 0.5) == {"step/plain_s": 11.5, "step/speedup_measured": 1.15}


def test_the_trainer_times_the_draft_s_training_and_reports_the_step_speedup_on_measured_steps(tmp_path):
    cfg = load_config(None, [*TINY, "draft.family=eagle3", "rl.measure_speedup_every=2", "rl.drift_every=0",
                             "rl.frozen_draft_every=2", f"run.dir={tmp_path}"])
    trainer = Trainer(cfg, tmp_path)
    steps = [trainer.train_step() for _ in range(4)]
    assert ["step/speedup_measured" in m for m in steps] == [False, True, False, True]
    for m in steps:
        assert 0 < m["time/draft_train_s"] < m["time/train_s"] < m["time/step_s"]
    # the frozen control is scored on steps 2 and 4, outside the step's seconds
    assert [m["time/frozen_draft_s"] > 0 for m in steps] == [False, True, False, True]
    for m in steps[1], steps[3]:
        parts = m["time/step_s"] - m["rollout/spec_s"] - m["time/draft_train_s"] + m["rollout/plain_s"]
        assert m["step/plain_s"] == pytest.approx(parts, rel=1e-12)
        assert m["step/speedup_measured"] == pytest.approx(m["step/plain_s"] / m["time/step_s"], rel=1e-12)


def test_codraft_train_closes_with_both_measured_speedups(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="codraft.commands.train")
    assert main(["train", *TINY, "draft.family=eagle3", "rl.steps=2", "rl.measure_speedup_every=1", "rl.drift_every=0",
                 f"run.dir={tmp_path}"]) == 0
    rollout = next(r.message for r in caplog.records if r.message.startswith("speculative rollout vs plain"))
    step = next(r.message for r in caplog.records if r.message.startswith("training step vs the same step"))
    assert "over 2 steps" in rollout and "over 2 steps" in step and "(seconds without a draft over the step's" in step


def test_no_measurement_without_a_draft(tmp_path):
    cfg = load_config(None, [*TINY, "draft.family=none", "rl.measure_speedup_every=1", "rl.drift_every=0",
                             f"run.dir={tmp_path}"])
    metrics = Trainer(cfg, tmp_path).train_step()
    assert not {"rollout/speedup_measured", "step/speedup_measured", "time/draft_train_s"} & set(metrics)
