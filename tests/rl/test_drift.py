"""Policy drift from step 0 (rl/drift.py): zero for the step-0 weights, the KL it names, wired into the trainer."""


import pytest
import torch
import torch.nn.functional as F

from codraft.config import load_config
from codraft.models import load_model
from codraft.rl.drift import DriftProbe
from codraft.train.trainer import Trainer
from tests.train.test_trainer import TINY, deterministic, full_and_resumed

PROMPTS = [[257, 10, 20, 30], [257, 40, 50, 60, 70, 80], [257, 90]]


@pytest.fixture
def policy():
    model, _ = load_model("tiny-llama")
    return model.eval()


def nudge(policy) -> None:
    """One AdamW step on a next-token loss: every weight moves a little, as in training."""
    opt = torch.optim.AdamW(policy.parameters(), lr=1e-3)
    ids = torch.tensor([[257, 1, 2, 3, 4, 5, 6, 7]])
    logits = policy(ids).logits[0, :-1]
    F.cross_entropy(logits, ids[0, 1:]).backward()
    opt.step()


def test_drift_is_exactly_zero_for_the_step0_policy_and_positive_after_an_update(policy):
    probe = DriftProbe(policy, PROMPTS, max_new_tokens=6)
    assert probe.num_tokens > 0
    assert probe.measure(policy)["drift/kl_step0"] == 0.0
    nudge(policy)
    assert probe.measure(policy)["drift/kl_step0"] > 0.0


def greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    """The greedy continuation, one full forward per token (no KV cache, no engine)."""
    response: list[int] = []
    for _ in range(max_new_tokens):
        with torch.no_grad():
            token = int(model(torch.tensor([prompt + response])).logits[0, -1].argmax())
        response.append(token)
        if token in model.args.eos_token_id:
            break
    return response


def test_drift_is_the_token_mean_kl_of_current_from_step0_on_the_step0_greedy_answers(policy):
    probe = DriftProbe(policy, PROMPTS, max_new_tokens=6)
    reference, _ = load_model("tiny-llama")  # the same seeded weights: the step-0 policy
    nudge(policy)
    ref_rows, cur_rows = [], []
    for prompt in PROMPTS:  # each sequence on its own and unpadded
        response = greedy(reference, prompt, 6)
        ids, rows = torch.tensor([prompt + response]), slice(len(prompt) - 1, len(prompt) + len(response) - 1)
        with torch.no_grad():
            ref_rows.append(reference(ids).logits[0, rows].log_softmax(-1))
            cur_rows.append(policy(ids).logits[0, rows].log_softmax(-1))
    ref, cur = torch.cat(ref_rows), torch.cat(cur_rows)
    kl_cur_ref = float(F.kl_div(ref, cur, log_target=True, reduction="none").sum(-1).mean())  # KL(cur || ref)
    kl_ref_cur = float(F.kl_div(cur, ref, log_target=True, reduction="none").sum(-1).mean())
    assert probe.num_tokens == len(ref)
    drift = probe.measure(policy)["drift/kl_step0"]
    assert drift == pytest.approx(kl_cur_ref, rel=1e-4)
    assert drift != pytest.approx(kl_ref_cur, rel=1e-3)  # the direction is told apart, and it is cur || step-0


def test_trainer_logs_drift_every_n_steps_without_changing_the_training(tmp_path):
    def run(drift_every: int) -> tuple[list[dict], dict]:
        cfg = load_config(None, [*TINY, "draft.family=none", f"rl.drift_every={drift_every}", "rl.drift_prompts=2",
                                 f"run.dir={tmp_path / str(drift_every)}"])
        trainer = Trainer(cfg, tmp_path / str(drift_every))
        assert (trainer.drift is None) == (drift_every == 0)  # off: nothing of the step-0 policy is kept
        return [trainer.train_step() for _ in range(4)], trainer.policy.state_dict()

    (off, off_weights), (every2, weights2) = run(0), run(2)
    assert not any("drift/kl_step0" in m for m in off)
    assert ["drift/kl_step0" in m for m in every2] == [False, True, False, True]
    assert 0 < every2[1]["drift/kl_step0"] < every2[3]["drift/kl_step0"]  # lr 1e-3 keeps moving the policy away
    assert all(torch.equal(off_weights[k], weights2[k]) for k in off_weights)  # measuring does not perturb training
    for a, b in zip(off, every2, strict=True):
        assert deterministic(a) == pytest.approx(
            {k: v for k, v in deterministic(b).items() if k != "drift/kl_step0"}, rel=0, abs=0, nan_ok=True
        )


def test_a_resumed_run_measures_drift_from_the_first_run_s_step0(tmp_path):
    runs = full_and_resumed(tmp_path, [*TINY, "draft.family=none", "rl.drift_every=2", "rl.drift_prompts=2"])
    drift = [[m.get("drift/kl_step0") for m in rows] for rows in runs]
    assert drift[0] == drift[1] and drift[0][1] > 0 and drift[0][3] > 0
    assert runs[1][-1]["step"] == 4
