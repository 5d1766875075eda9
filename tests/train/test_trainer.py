"""The co-training step: the draft never moves the policy, resume is exact, every metric is written."""

import itertools
import json

import pytest
import torch

from codraft.bench.soak import MACHINE
from codraft.cli import main
from codraft.config import load_config
from codraft.models import Transformer
from codraft.train.objective import JointObjective
from codraft.train.trainer import Trainer

DESIGN_METRICS = [
    "reward/mean",
    "reward/accuracy",
    "reward/final_answer_accuracy",
    "reward/flat_groups",
    "loss/policy",
    "loss/draft",
    "grad_norm/policy",
    "grad_norm/draft",
    "kl/train_inference",
    "token_mult_prob_error",
    "entropy",
    "response_length/mean",
    "spec/acceptance_length",
    "spec/accept_rate_pos_0",
    "spec/draft_tokens",
    "rollout/tokens_per_s",
    "spec/mean_k",
    "time/rollout_s",
    "time/rollout_draft_s",
    "time/rollout_verify_s",
    "time/rollout_prefill_s",
    "time/train_s",
    "time/refit_s",
    "time/step_s",
    "memory/rss_mib",
]
TINY = [
    "model.path=tiny-llama",
    "checkpoint.draft_init=none",
    "rl.prompts_per_step=2",
    "rl.group_size=3",
    "rl.max_new_tokens=6",
    "task.max_operand=9",
    "run.tensorboard=false",
    "rl.adaptive=false",
    "draft.num_anchors=2",
    "task.reward=tests.train.test_trainer:length_reward",
    "optim.lr=1e-3",
]


def length_reward(completion: str, problem) -> float:
    """A reward with variance inside groups even for a random policy, so the policy really moves."""
    return len(completion) / 10


def raising_reward(completion: str, problem) -> float:
    return 1 / 0


def nan_reward(completion: str, problem) -> float:
    return float("nan")


def text_reward(completion: str, problem) -> str:
    return "1.0"


CALLS = itertools.count()


def sometimes_raising_reward(completion: str, problem) -> float:
    """Raises on one call in six: one sample of each step's 2 x 3, under the default share."""
    if next(CALLS) % 6 == 0:
        raise KeyError("rare")
    return len(completion) / 10


def policy_grads(tmp_path, draft_weight: float, family: str) -> tuple[dict, Trainer]:
    """Policy gradients of one step, taken where the optimizer would apply them."""
    cfg = load_config(
        None,
        [*TINY, f"rl.draft_weight={draft_weight}", f"draft.family={family}", f"run.dir={tmp_path / str(draft_weight)}"],
    )
    trainer = Trainer(cfg, tmp_path)
    grads = {}
    step = trainer.policy_opt.step
    trainer.policy_opt.step = lambda: grads.update(
        {n: p.grad.clone() for n, p in trainer.policy.named_parameters() if p.grad is not None}
    )
    trainer.train_step()
    trainer.policy_opt.step = step
    return grads, trainer


@pytest.mark.filterwarnings(r"ignore:Seems like `optimizer.step\(\)`")
@pytest.mark.parametrize("family", ["eagle3", "dflash", "dspark"])
def test_policy_gradient_is_bit_identical_with_and_without_the_draft_loss(tmp_path, family):
    with_draft, _ = policy_grads(tmp_path, 1.0, family)
    without, _ = policy_grads(tmp_path, 0.0, family)
    assert with_draft.keys() == without.keys() and with_draft
    for name in with_draft:
        assert torch.equal(with_draft[name], without[name]), name


def step_grads(cfg, tmp_path) -> dict[str, torch.Tensor]:
    """Every gradient of one train step, policy and draft, taken where the optimizers would step."""
    trainer = Trainer(cfg, tmp_path)
    grads = {}
    modules = (("policy", trainer.policy, trainer.policy_opt), ("draft", trainer.draft, trainer.draft_opt))
    for name, module, opt in modules:
        opt.step = lambda name=name, module=module: grads.update(
            {f"{name}.{n}": p.grad.clone() for n, p in module.named_parameters() if p.grad is not None})
    trainer.train_step()
    return grads


@pytest.mark.filterwarnings(r"ignore:Seems like `optimizer.step\(\)`")
def test_bf16_policy_matmuls_change_the_policy_gradient_by_rounding_only(tmp_path):
    """rl.policy_matmul_dtype=bfloat16 autocasts the policy's training forward: the same rollout (inference is
    untouched) gives policy gradients that differ from the fp32 run's (the setting took effect) and point the same
    way, and the RL metrics computed from the fp32 head agree closely."""
    grads, metrics = {}, {}
    for dtype in ("float32", "bfloat16"):
        cfg = load_config(None, [*TINY, f"rl.policy_matmul_dtype={dtype}", "rl.drift_every=0",
                                 "rl.measure_speedup_every=0", f"run.dir={tmp_path / dtype}"])
        trainer = Trainer(cfg, tmp_path / dtype)
        trainer.policy_opt.step = lambda t=trainer, d=dtype: grads.update(
            {d: torch.cat([p.grad.flatten() for p in t.policy.parameters() if p.grad is not None])})
        metrics[dtype] = trainer.train_step()
    assert not torch.equal(grads["float32"], grads["bfloat16"])
    assert torch.nn.functional.cosine_similarity(grads["float32"], grads["bfloat16"], dim=0) > 0.99
    assert metrics["float32"]["response_length/mean"] == metrics["bfloat16"]["response_length/mean"]
    kl = {d: m["kl/train_inference"] for d, m in metrics.items()}
    assert kl["bfloat16"] == pytest.approx(kl["float32"], abs=1e-2)


@pytest.mark.filterwarnings(r"ignore:Seems like `optimizer.step\(\)`")
def test_bf16_draft_matmuls_in_co_training_keep_the_policy_gradient_and_the_draft_s_direction(tmp_path):
    """rl.draft_matmul_dtype=bfloat16 autocasts the draft's loss only: the policy's gradients are bitwise the
    fp32 run's, the draft's differ by bf16 rounding (so the setting took effect) and point the same way."""
    grads = {}
    for dtype in ("float32", "bfloat16"):
        cfg = load_config(None, [*TINY, "draft.family=eagle3", "rl.draft_weight=1.0", f"rl.draft_matmul_dtype={dtype}",
                                 "rl.drift_every=0", "rl.measure_speedup_every=0", f"run.dir={tmp_path / dtype}"])
        grads[dtype] = step_grads(cfg, tmp_path / dtype)
    fp32, bf16 = grads["float32"], grads["bfloat16"]
    assert fp32.keys() == bf16.keys()
    for name in (n for n in fp32 if n.startswith("policy.")):
        assert torch.equal(fp32[name], bf16[name]), name
    draft = [n for n in fp32 if n.startswith("draft.")]
    flat = {d: torch.cat([g[n].flatten() for n in draft]) for d, g in grads.items()}
    assert not torch.equal(flat["float32"], flat["bfloat16"])
    assert torch.nn.functional.cosine_similarity(flat["float32"], flat["bfloat16"], dim=0) > 0.99


@pytest.mark.filterwarnings(r"ignore:Seems like `optimizer.step\(\)`")
@pytest.mark.parametrize("family", ["eagle3", "dflash", "dspark"])
def test_prompts_run_once_per_group_give_the_rows_gradients(tmp_path, family):
    """rl.share_prompts (models/shared_prefix.py): the step's policy and draft gradients are those of the rows
    laid out one by one, to rounding."""
    grads = {}
    for share in (True, False):
        cfg = load_config(None, [*TINY, f"draft.family={family}", f"rl.share_prompts={share}", "rl.drift_every=0",
                                 "rl.draft_matmul_dtype=float32",
                                 "rl.measure_speedup_every=0", f"run.dir={tmp_path / str(share)}"])
        grads[share] = step_grads(cfg, tmp_path / str(share))
    assert grads[True].keys() == grads[False].keys() and any(k.startswith("draft.") for k in grads[True])
    for name, rows_grad in grads[False].items():
        torch.testing.assert_close(grads[True][name], rows_grad, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.filterwarnings(r"ignore:Seems like `optimizer.step\(\)`")
@pytest.mark.parametrize("family", ["eagle3", "dflash", "dspark"])
def test_the_head_on_response_rows_only_gives_the_full_head_s_gradients(tmp_path, family, monkeypatch):
    cfg = load_config(None, [*TINY, f"draft.family={family}", "rl.drift_every=0", "rl.measure_speedup_every=0",
                             f"run.dir={tmp_path}"])
    rows_only = step_grads(cfg, tmp_path)
    monkeypatch.setattr(Transformer, "logits_at", lambda self, x, rows: self.logits(x))  # every row, as before
    full = step_grads(cfg, tmp_path)
    assert rows_only.keys() == full.keys() and any(k.startswith("draft.") for k in full)
    for name in full:
        torch.testing.assert_close(rows_only[name], full[name], rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.filterwarnings(r"ignore:Seems like `optimizer.step\(\)`")
@pytest.mark.parametrize("family", ["eagle3", "dflash", "dspark"])
def test_a_backward_per_term_gives_the_joint_loss_s_gradients_bit_for_bit(tmp_path, family, monkeypatch):
    """The trainer runs the draft term's backward apart, to time it: every gradient, policy and draft, is the one
    backward over their sum gives."""
    cfg = load_config(None, [*TINY, f"draft.family={family}", "rl.drift_every=0", "rl.measure_speedup_every=0",
                             f"run.dir={tmp_path}"])
    apart = step_grads(cfg, tmp_path)
    terms = JointObjective.terms

    def summed(self, m, logits, taps):
        rl_term, draft_term = terms(self, m, logits, taps)
        return rl_term + draft_term, None

    monkeypatch.setattr(JointObjective, "terms", summed)
    joint = step_grads(cfg, tmp_path)
    assert apart.keys() == joint.keys() and any(k.startswith("draft.") for k in joint)
    for name in joint:
        assert torch.equal(apart[name], joint[name]), name


def test_taps_and_draft_targets_carry_no_gradient_into_the_policy(tmp_path):
    cfg = load_config(None, [*TINY, f"run.dir={tmp_path}"])
    trainer = Trainer(cfg, tmp_path)
    ids = torch.randint(0, 200, (1, 12))
    out = trainer.policy(ids, cu_seqlens=torch.tensor([0, 5, 12]), taps=trainer.draft.tap_layers)
    from codraft.drafts import DraftBatch

    loss, _ = trainer.draft.loss(
        DraftBatch(
            input_ids=ids[0],
            taps={i: t[0] for i, t in out.taps.items()},  # deliberately NOT detached here
            policy_logits=out.logits[0],
            loss_mask=torch.ones(12, dtype=torch.bool),
            cu_seqlens=torch.tensor([0, 5, 12]),
        )
    )
    loss.backward()
    assert all(p.grad is None for p in trainer.policy.parameters())
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in trainer.draft.parameters())


def run_metrics(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def deterministic(m: dict) -> dict:
    return {k: v for k, v in m.items() if not k.startswith(MACHINE)}


def full_and_resumed(tmp_path, overrides: list[str]) -> tuple[list[dict], list[dict]]:
    """The metrics of `codraft train` for 4 steps, and of 2 steps resumed to 4, with `overrides`."""
    full, part = tmp_path / "full", tmp_path / "part"
    assert main(["train", *overrides, "rl.steps=4", f"run.dir={full}"]) == 0
    assert main(["train", *overrides, "rl.steps=2", f"run.dir={part}"]) == 0
    assert main(["train", "--resume", str(part), "rl.steps=4"]) == 0
    return run_metrics(full), run_metrics(part)


def test_resume_continues_exactly_like_an_uninterrupted_run(tmp_path):
    a, b = full_and_resumed(tmp_path, TINY)
    assert [m["step"] for m in b] == [1, 2, 3, 4]
    for x, y in zip(a, b, strict=True):
        assert deterministic(x) == pytest.approx(deterministic(y), rel=0, abs=0, nan_ok=True)


def test_resume_refuses_an_incompatible_config_and_a_missing_dir(tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["train", *TINY, "rl.steps=1", f"run.dir={run}"]) == 0
    assert main(["train", "--resume", str(run), "rl.steps=2", "rl.group_size=4"]) == 2
    assert "trained with a different config (rl.group_size)" in capsys.readouterr().err
    assert main(["train", "--resume", str(tmp_path / "nope")]) == 2
    assert "no config.yaml there" in capsys.readouterr().err


@pytest.mark.parametrize("family", ["eagle3", "dflash", "dspark", "none"])
def test_a_short_run_of_each_family_writes_every_metric(tmp_path, family):
    assert (
        main(["train", *TINY, "rl.steps=2", f"draft.family={family}", f"run.dir={tmp_path}", "run.tensorboard=true"])
        == 0
    )
    rows = run_metrics(tmp_path)
    assert [r["step"] for r in rows] == [1, 2]
    assert rows[-1]["grad_norm/policy"] > 0  # the policy did get a learning signal
    assert rows[-1]["memory/rss_mib"] > 0
    wanted = (
        DESIGN_METRICS
        if family != "none"
        else [m for m in DESIGN_METRICS if m not in ("loss/draft", "grad_norm/draft", "spec/accept_rate_pos_0")]
    )
    for name in wanted:
        assert name in rows[-1], name
    assert list(tmp_path.glob("events.out.tfevents.*"))
    assert (tmp_path / "checkpoints" / "latest").read_text() == "step_000002"
    assert "time/release_memory_s" not in rows[-1]  # run.host_memory=keep: nothing is handed back


def test_adaptive_speculation_logs_its_choices(tmp_path):
    """Every step logs the k its verify steps chose and what they drafted (at most k = 4); the first rollout's
    probe at least speculates (whether a later one probes depends on the probe's timed cost)."""
    assert main(["train", *TINY, "rl.steps=2", "rl.adaptive=true", "rl.max_new_tokens=12", "draft.family=eagle3",
                 f"run.dir={tmp_path}"]) == 0
    rows = run_metrics(tmp_path)
    assert rows[0]["spec/mean_k"] > 0
    assert all((r["spec/drafts_per_step"] > 0) == (r["spec/mean_k"] > 0) and r["spec/drafts_per_step"] <= 4
               for r in rows), rows


def test_release_mode_hands_memory_back_after_each_step_and_times_it(tmp_path):
    assert main(["train", *TINY, "rl.steps=1", "draft.family=none", "run.host_memory=release",
                 f"run.dir={tmp_path}"]) == 0
    assert run_metrics(tmp_path)[-1]["time/release_memory_s"] >= 0


def files(run_dir) -> dict[str, bytes]:
    return {str(p.relative_to(run_dir)): p.read_bytes() for p in sorted(run_dir.rglob("*")) if p.is_file()}


def test_a_refused_resume_changes_nothing_on_disk(tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["train", *TINY, "rl.steps=1", f"run.dir={run}"]) == 0
    before = files(run)
    assert main(["train", "--resume", str(run), "rl.steps=2", "draft.family=dflash"]) == 2
    assert "was trained with a different config (draft.family)" in capsys.readouterr().err
    # refused before relaunching on 2 ranks: the relaunch would have written config.yaml with pp=2
    assert main(["train", "--resume", str(run), "rl.steps=2", "parallel.pp=2"]) == 2
    assert "without pipeline parallelism; resume it with parallel.pp=1 (got parallel.pp=2)" in capsys.readouterr().err
    assert files(run) == before  # config.yaml byte for byte, metrics, checkpoints
    # so a plain resume still works; the step budget and the reward guard may change
    assert main(["train", "--resume", str(run), "rl.steps=2", "rl.max_dropped_steps=5"]) == 0
    assert [m["step"] for m in run_metrics(run)] == [1, 2]


def test_resume_past_a_truncated_checkpoint_logs_every_step_once_and_exactly(tmp_path, capsys):
    full, part = tmp_path / "full", tmp_path / "part"
    assert main(["train", *TINY, "rl.steps=4", f"run.dir={full}"]) == 0
    assert main(["train", *TINY, "rl.steps=3", "checkpoint.every=2", f"run.dir={part}"]) == 0
    policy = part / "checkpoints" / "step_000003" / "policy.safetensors"
    policy.write_bytes(policy.read_bytes()[: policy.stat().st_size // 2])  # a crash mid-copy, say
    capsys.readouterr()
    assert main(["train", "--resume", str(part), "rl.steps=4"]) == 0
    warnings = [line for line in capsys.readouterr().err.splitlines() if " WARNING " in line]
    assert len(warnings) == 1 and "step_000002" in warnings[0] and "step_000003 (policy.safetensors has" in warnings[0]
    a, b = run_metrics(full), run_metrics(part)
    assert [m["step"] for m in b] == [1, 2, 3, 4]  # step 3 of the first run was dropped, not repeated
    for x, y in zip(a, b, strict=True):
        assert deterministic(x) == pytest.approx(deterministic(y), rel=0, abs=0, nan_ok=True)


def test_resume_without_a_complete_checkpoint_is_one_line(tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["train", *TINY, "rl.steps=1", f"run.dir={run}"]) == 0
    (run / "checkpoints" / "latest").unlink()
    (run / "checkpoints" / "step_000001" / "meta.json").unlink()  # SIGKILL during the very first checkpoint
    capsys.readouterr()
    assert main(["train", "--resume", str(run), "rl.steps=2"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"codraft: error: checkpoint.resume: {run / 'checkpoints'} holds no complete checkpoint; "
                          "skipped no 'latest' pointer, step_000001 (meta.json: ")
    assert err.count("\n") == 1


@pytest.mark.parametrize("reward, error", [
    ("raising_reward", "raised ZeroDivisionError: division by zero"),
    ("nan_reward", "returned a non-finite value (nan)"),
    ("text_reward", "returned str '1.0', not a number"),
])
def test_a_run_whose_reward_drops_every_sample_fails_naming_the_function_and_its_error(tmp_path, capsys, reward,
                                                                                      error):
    spec = f"tests.train.test_trainer:{reward}"
    assert main(["train", *TINY, "rl.steps=10", f"task.reward={spec}", f"run.dir={tmp_path}"]) == 2
    last = capsys.readouterr().err.splitlines()[-1]
    assert last == (f"codraft: error: task.reward: the reward function '{spec}' dropped more than 50% of the samples "
                    "for 3 consecutive steps (rl.max_dropped_share, rl.max_dropped_steps), so the run trains on "
                    f"nothing; its first error: {error}")
    assert [r["step"] for r in run_metrics(tmp_path)] == [1, 2]  # the third such step is refused before its update


def test_dropping_a_few_samples_or_a_disabled_guard_does_not_stop_the_run(tmp_path):
    sometimes = "task.reward=tests.train.test_trainer:sometimes_raising_reward"
    assert main(["train", *TINY, "rl.steps=4", sometimes, f"run.dir={tmp_path / 'a'}"]) == 0
    assert [r["reward/dropped"] for r in run_metrics(tmp_path / "a")] == [1.0] * 4
    assert main(["train", *TINY, "rl.steps=4", "task.reward=tests.train.test_trainer:raising_reward",
                 "rl.max_dropped_steps=0", f"run.dir={tmp_path / 'b'}"]) == 0
    assert [r["reward/dropped"] for r in run_metrics(tmp_path / "b")] == [6.0] * 4
