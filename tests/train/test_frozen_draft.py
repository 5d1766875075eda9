"""rl.frozen_draft_every: the run's initial draft, never updated, scored beside the trained one on the same batch."""

import pytest
import torch

from codraft.config import ConfigError, load_config
from codraft.train.objective import frozen_name
from codraft.train.trainer import Trainer
from tests.train.test_trainer import TINY, deterministic, full_and_resumed


def frozen_metrics(m: dict) -> dict:
    return {k: v for k, v in m.items() if k.startswith("frozen_draft/")}


def trained_metrics(m: dict) -> dict:
    """The trained draft's loss metrics under the frozen draft's names."""
    return {frozen_name(k): v for k, v in m.items()
            if k.startswith(("draft/", "loss/draft")) and k != "draft/skipped_steps"}


@pytest.mark.parametrize("family", ["eagle3", "dflash", "dspark"])
def test_the_frozen_draft_scores_as_the_trained_one_until_it_trains_and_changes_nothing(tmp_path, family):
    def run(every: int) -> tuple[list[dict], Trainer, dict]:
        cfg = load_config(None, [*TINY, f"draft.family={family}", f"rl.frozen_draft_every={every}",
                                 "rl.drift_every=0", "rl.measure_speedup_every=0", "optim.draft_lr=1e-2",
                                 "rl.max_new_tokens=12", "draft.block_size=4",  # DFlash/DSpark anchors in the answers
                                 f"run.dir={tmp_path / str(every)}"])
        trainer = Trainer(cfg, tmp_path / str(every))
        initial = {k: v.clone() for k, v in trainer.draft.state_dict().items()}
        metrics = [trainer.train_step() for _ in range(3)]
        return metrics, trainer, initial

    (off, off_trainer, _), (on, trainer, initial) = run(0), run(1)
    assert all(m["grad_norm/draft"] > 0 for m in on)  # the trained draft did train
    assert off_trainer.frozen_draft is None
    frozen = trainer.frozen_draft
    assert all(not p.requires_grad for p in frozen.parameters())
    assert frozen._embed.data_ptr() == trainer.policy.embed_tokens.weight.data_ptr()  # the current policy's
    assert all(torch.equal(frozen.state_dict()[k], v) for k, v in initial.items())  # never updated
    assert any(not torch.equal(trainer.draft.state_dict()[k], v) for k, v in initial.items())  # the other trained
    # step 1: the same weights on the same batch (and, DFlash/DSpark, the same anchors, the same head) score the same
    assert frozen_metrics(on[0]) and frozen_metrics(on[0]) == trained_metrics(on[0])
    assert frozen_metrics(on[2]) != pytest.approx(trained_metrics(on[2]), rel=1e-3)  # then they part
    # scoring it changes nothing of the run: every other metric, and the weights, as without it
    for a, b in zip(off, on, strict=True):
        assert deterministic(a) == pytest.approx({k: v for k, v in deterministic(b).items()
                                                  if not k.startswith("frozen_draft/")}, rel=0, abs=0, nan_ok=True)
    for module, other in ((trainer.policy, off_trainer.policy), (trainer.draft, off_trainer.draft)):
        assert all(torch.equal(v, other.state_dict()[k]) for k, v in module.state_dict().items())


def test_the_frozen_draft_is_scored_every_n_steps_and_stays_the_initial_one_across_a_resume(tmp_path):
    runs = full_and_resumed(tmp_path, [*TINY, "draft.family=eagle3", "rl.frozen_draft_every=2", "rl.drift_every=0"])
    assert [bool(frozen_metrics(m)) for m in runs[0]] == [False, True, False, True]
    assert [frozen_metrics(m) for m in runs[0]] == [frozen_metrics(m) for m in runs[1]]


def test_a_non_finite_trained_draft_loss_logs_no_pair(tmp_path):
    cfg = load_config(None, [*TINY, "draft.family=eagle3", "rl.frozen_draft_every=1", "rl.drift_every=0",
                             f"run.dir={tmp_path}"])
    trainer = Trainer(cfg, tmp_path)
    loss = trainer.draft.loss
    trainer.draft.loss = lambda batch: (loss(batch)[0] * float("nan"), loss(batch)[1])
    metrics = trainer.train_step()
    assert metrics["loss/draft"] != metrics["loss/draft"] and not frozen_metrics(metrics)


def test_frozen_draft_every_is_validated():
    with pytest.raises(ConfigError, match="rl.frozen_draft_every"):
        load_config(None, ["rl.frozen_draft_every=-1"])
    with pytest.raises(ConfigError, match="rl.frozen_draft_every.* must be 0 when rl.optimizer_steps_per_batch > 1"):
        load_config(None, ["rl.frozen_draft_every=5", "rl.optimizer_steps_per_batch=2"])


def test_frozen_metric_names():
    assert [frozen_name(k) for k in ("draft/acc_pos_0", "loss/draft", "loss/draft_ce")] == [
        "frozen_draft/acc_pos_0", "frozen_draft/loss", "frozen_draft/loss_ce"]
