"""KL to a frozen reference (rl.beta > 0): the k3 term against values computed by hand, the reference the
trainer keeps (a copy of the initial policy, or model.ref_path; none at beta = 0; under PP each stage holds only
its layers), and the loss with beta under cp=2 and pp=2 equal to pp=1's."""

import pytest
import torch

from codraft.cli import main
from codraft.config import ConfigError, load_config
from codraft.parallel.mesh import ParallelDims
from codraft.rl.grpo import grpo_loss
from codraft.train.trainer import Trainer
from tests.distributed import run_workers
from tests.train.test_trainer_cp import TINY, fixed_rollout

BETA = [*TINY, "draft.family=none", "rl.beta=0.1"]


def test_k3_kl_term_matches_values_computed_by_hand():
    logprobs = torch.tensor([[-1.0, -2.0, -0.5]])
    ref = torch.tensor([[-1.5, -1.0, -0.5]])
    mask = torch.tensor([[True, True, False]])  # the third token is padding: left out
    loss, metrics = grpo_loss(logprobs, logprobs, torch.zeros(1), mask, beta=0.1, ref_logprobs=ref)
    # k3(x) = exp(x) - x - 1 at x = ref - logprobs: x = -0.5 -> 0.1065306597, x = 1.0 -> 0.7182818285
    assert metrics["kl/ref"] == pytest.approx((0.1065306597 + 0.7182818285) / 2, rel=1e-6)
    assert loss.item() == pytest.approx(0.1 * 0.4124062441, rel=1e-6)  # advantage 0: the KL term alone


def test_beta_zero_keeps_no_reference_and_beta_keeps_a_frozen_copy_of_the_initial_policy(tmp_path):
    assert Trainer(load_config(None, [*TINY, "draft.family=none", f"run.dir={tmp_path}"]), tmp_path).reference is None
    trainer = Trainer(load_config(None, [*BETA, f"run.dir={tmp_path}"]), tmp_path)
    ref = trainer.reference
    assert ref is not None and ref is not trainer.policy and not any(p.requires_grad for p in ref.parameters())
    for (name, p), q in zip(trainer.policy.named_parameters(), ref.parameters(), strict=True):
        assert torch.equal(p, q) and p.data_ptr() != q.data_ptr(), name


def test_codraft_train_with_beta_trains_and_logs_kl_ref(tmp_path):
    run = tmp_path / "run"
    assert main(["train", *BETA, "rl.steps=2", "optim.lr=1e-2", f"run.dir={run}"]) == 0
    from tests.train.test_trainer import run_metrics

    rows = run_metrics(run)
    assert rows[0]["kl/ref"] == pytest.approx(0.0, abs=1e-6)  # step 1: the policy is still the reference
    assert rows[1]["kl/ref"] > 0 and rows[1]["loss/policy"] is not None


def test_model_ref_path_must_be_the_policy_s_architecture(tmp_path):
    cfg = load_config(None, [*BETA, "model.ref_path=tiny-qwen3", f"run.dir={tmp_path}"])
    with pytest.raises(ConfigError, match="model.ref_path: tiny-qwen3 is not the architecture of model.path"):
        Trainer(cfg, tmp_path)
    same = Trainer(load_config(None, [*BETA, "model.ref_path=tiny-llama", f"run.dir={tmp_path}"]), tmp_path)
    assert all(torch.equal(p, q) for p, q in zip(same.policy.parameters(), same.reference.parameters(), strict=True))


def _reference_part(rank: int, world_size: int, run_dir: str):
    trainer = Trainer(load_config(None, [*BETA, f"run.dir={run_dir}", f"parallel.pp={world_size}"]), run_dir)
    policy = trainer.policy.state_dict()
    part = {n: (torch.equal(p, policy[n if n in policy else "embed_tokens.weight"]),
                any(p.data_ptr() == q.data_ptr() for q in policy.values()), p.requires_grad)
            for n, p in trainer.reference.named_parameters()}
    return part, trainer.policy.args.num_layers


def test_under_pp2_each_stage_s_reference_holds_only_its_stage_s_layers(tmp_path):
    (first, num_layers), (last, _) = run_workers(_reference_part, 2, str(tmp_path), timeout=120)
    assert num_layers == 4  # tiny-llama: layers 0-1 on stage 0, 2-3 on stage 1
    layers = {stage: {int(n.split(".")[1]) for n in part if n.startswith("layers.")}
              for stage, part in enumerate((first, last))}
    assert layers == {0: {0, 1}, 1: {2, 3}}
    assert "embed_tokens.weight" in first and not {"norm.weight", "lm_head.weight"} & first.keys()
    assert "embed_tokens.weight" not in last and {"norm.weight", "lm_head.weight"} <= last.keys()
    for name, (equal, shared, trainable) in first.items() | last.items():  # a frozen copy of the initial policy
        assert equal and not shared and not trainable, name


def perturbed_update(trainer: Trainer) -> tuple[dict, dict]:
    """One update on the fixed rollout after the same small change to the full policy on every rank (so the
    policy is no longer its reference); its metrics and the policy gradients it would apply."""
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():  # the stage under PP is a view of these tensors
        for p in trainer.policy.parameters():
            p.add_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.05)
    grads = {}
    trainer.policy_opt.step = lambda: grads.update(
        {n: p.grad.numpy().copy() for n, p in trainer.stage.named_parameters() if p.grad is not None})
    torch.manual_seed(1)
    return trainer._update(*fixed_rollout(trainer.policy.args.vocab_size)), grads


def _beta_layout_matches_single(rank: int, world_size: int, layout: str, run_dir: str):
    cfg = load_config(None, [*BETA, f"run.dir={run_dir}", f"parallel.{layout}={world_size}"])
    single = Trainer(cfg, run_dir, ParallelDims.single())
    return perturbed_update(single), perturbed_update(Trainer(cfg, run_dir))


@pytest.mark.filterwarnings(r"ignore:Seems like `optimizer.step\(\)`")
@pytest.mark.parametrize("layout", ["cp", "pp"])
def test_loss_with_beta_under_cp2_and_pp2_equals_pp1(tmp_path, layout):
    for (m1, g1), (m2, g2) in run_workers(_beta_layout_matches_single, 2, layout, str(tmp_path), timeout=120):
        assert m1["kl/ref"] > 1e-4  # the perturbed policy is away from its reference
        for key in ("loss/policy", "kl/ref", "grad_norm/policy"):
            assert m2[key] == pytest.approx(m1[key], rel=1e-5, abs=1e-7), key
        for name, g in g2.items():  # a stage's parameters under PP, all of them under CP
            ref = name if name in g1 else "embed_tokens.weight"  # the last stage's copy of a tied head
            torch.testing.assert_close(torch.from_numpy(g), torch.from_numpy(g1[ref]), rtol=1e-4, atol=1e-5,
                                       msg=name)


def _train(rank: int, world_size: int, overrides: list[str]) -> int:
    return main(["train", *overrides])


@pytest.mark.parametrize("layout", ["parallel.cp=2", "parallel.pp=2"])
def test_codraft_train_with_beta_runs_under_cp2_and_pp2(tmp_path, layout):
    from tests.train.test_trainer import run_metrics

    overrides = [*BETA, "rl.steps=2", "optim.lr=1e-2", layout, f"run.dir={tmp_path}"]
    assert run_workers(_train, 2, overrides, timeout=180) == [0, 0]
    rows = run_metrics(tmp_path)
    assert [r["step"] for r in rows] == [1, 2] and rows[1]["kl/ref"] > 0
