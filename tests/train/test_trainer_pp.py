"""The co-training step under pipeline parallelism, through the trainer: pp=2 gives the pp=1 loss and gradients,
refit leaves every rank with the same weights (dp replicas too), and `codraft train parallel.pp=2` writes a normal
run's metrics."""

import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from codraft.cli import main
from codraft.config import load_config
from codraft.parallel.dp_task import ReplicaTask
from codraft.parallel.mesh import ParallelDims
from codraft.rl.tasks import build_task
from codraft.train.trainer import Trainer
from tests.distributed import run_workers
from tests.train.test_trainer_cp import TINY, fixed_rollout

EAGLE3_EXACT = ["draft.family=eagle3", "draft.draft_vocab_size=0", "draft.ttt_steps=2"]  # split loss is exact


def captured_update(trainer: Trainer, policy: torch.nn.Module, batch: tuple | None = None) -> tuple[dict, dict]:
    """Metrics and the gradients the optimizers would apply (after clipping), of one update on the fixed rollout;
    `policy` is what the policy optimizer steps (the whole policy, or this rank's stage)."""
    grads = {}
    for name, opt, module in (("policy", trainer.policy_opt, policy), ("draft", trainer.draft_opt, trainer.draft)):
        if opt is not None:
            opt.step = lambda name=name, module=module: grads.update(
                {f"{name}.{n}": p.grad.numpy().copy() for n, p in module.named_parameters() if p.grad is not None}
            )
    metrics = trainer._update(*(batch or fixed_rollout(trainer.policy.args.vocab_size)))
    return metrics, grads


def _pp_matches_single(rank: int, world_size: int, draft: list[str], run_dir: str):
    cfg = load_config(None, [*TINY, *draft, f"run.dir={run_dir}", f"parallel.pp={world_size}"])
    single = Trainer(cfg, run_dir, ParallelDims.single())
    pp = Trainer(cfg, run_dir)
    return captured_update(single, single.policy), captured_update(pp, pp.stage)


@pytest.mark.filterwarnings(r"ignore:Seems like `optimizer.step\(\)`")
@pytest.mark.parametrize("draft", [["draft.family=none"], EAGLE3_EXACT, [*EAGLE3_EXACT, "model.path=tiny-qwen3"],
                                   ["draft.family=none", "rl.policy_matmul_dtype=bfloat16"]],
                         ids=["no-draft", "eagle3", "eagle3-untied-head", "no-draft-bf16-policy"])
def test_pp2_update_matches_pp1_loss_and_all_gradients(tmp_path, draft):
    results = run_workers(_pp_matches_single, 2, draft, str(tmp_path), timeout=120)
    (m1, g1), _ = results[0]
    pp_grads = {}
    for rank, (_, (m2, g2)) in enumerate(results):
        for key in ("loss/policy", "loss/draft", "grad_norm/policy", "grad_norm/draft", "entropy"):
            assert (key in m1) == (key in m2), key
            if key in m1:
                assert m2[key] == pytest.approx(m1[key], rel=1e-5, abs=1e-6), (rank, key)
        for name, g in g2.items():
            # a tied head (no name of its own at pp=1) is the last stage's copy of the embedding: same gradient
            ref = name if name in g1 else "policy.embed_tokens.weight"
            pp_grads.setdefault(ref, []).append(g)
    assert pp_grads.keys() == g1.keys()
    for name, grads in pp_grads.items():
        for g in grads:
            torch.testing.assert_close(torch.from_numpy(g), torch.from_numpy(g1[name]), rtol=1e-4, atol=1e-5,
                                       msg=name)


def _two_steps_then_weights(rank: int, world_size: int, run_dir: str, dp: int = 1):
    parallel = [f"parallel.dp={dp}", f"parallel.pp={world_size // dp}"]
    cfg = load_config(None, [*TINY, *EAGLE3_EXACT, f"run.dir={run_dir}", *parallel])
    trainer = Trainer(cfg, run_dir)
    before = {n: t.numpy().copy() for n, t in trainer.policy.state_dict().items()}
    metrics = [trainer.train_step() for _ in range(2)]
    weights = {f"policy.{n}": t.numpy().copy() for n, t in trainer.policy.state_dict().items()}
    weights |= {f"draft.{n}": t.numpy().copy() for n, t in trainer.draft.state_dict().items()}
    return before, weights, metrics


def test_refit_gives_every_rank_the_trained_weights(tmp_path):
    results = run_workers(_two_steps_then_weights, 2, str(tmp_path), timeout=120)
    (before, weights, metrics), (_, other, other_metrics) = results
    assert weights.keys() == other.keys()
    for name, w in weights.items():
        np.testing.assert_array_equal(w, other[name], err_msg=name)
    moved = [n for n, w in before.items() if not np.array_equal(w, weights[f"policy.{n}"])]
    assert "embed_tokens.weight" in moved and any(n.startswith("layers.0.") for n in moved)
    assert any(n.startswith("layers.3.") for n in moved)  # the last stage's layers reached rank 0's copy too
    for m, o in zip(metrics, other_metrics, strict=True):  # the train metrics came from the last stage
        assert m["loss/policy"] == o["loss/policy"] and m["grad_norm/draft"] == o["grad_norm/draft"]
        assert m["time/refit_s"] > 0


def _train(rank: int, world_size: int, overrides: list[str]) -> int:
    return main(["train", *overrides])


@pytest.mark.parametrize("parallel", [["parallel.pp=2"], ["parallel.pp=2", "parallel.cp=2"]], ids=["pp2", "pp2-cp2"])
def test_codraft_train_pp2_writes_every_metric_of_a_pp1_run(tmp_path, parallel):
    common = [*TINY, *EAGLE3_EXACT, "rl.steps=2", "rl.frozen_draft_every=1"]
    assert main(["train", *common, f"run.dir={tmp_path / 'pp1'}"]) == 0
    overrides = [*common, *parallel, f"run.dir={tmp_path / 'pp2'}"]
    world = 2 * (1 + ("parallel.cp=2" in parallel))
    assert run_workers(_train, world, overrides, timeout=180) == [0] * world
    rows = {pp: [json.loads(line) for line in (tmp_path / pp / "metrics.jsonl").read_text().splitlines()]
            for pp in ("pp1", "pp2")}
    assert [r["step"] for r in rows["pp2"]] == [1, 2]  # one writer
    for key in ("loss/policy", "loss/draft", "grad_norm/policy", "grad_norm/draft", "frozen_draft/loss"):
        assert rows["pp2"][0][key] == pytest.approx(rows["pp1"][0][key], rel=1e-4, abs=1e-6), key  # same rollout
    # the initial draft, scored on the last stage beside the trained one: the same weights at step 1
    assert rows["pp2"][0]["frozen_draft/loss"] == pytest.approx(rows["pp2"][0]["loss/draft"], rel=1e-6)
    # the draft's training is timed at pp = 1 only (trainer.py, _draft_time): under PP its backward runs inside the
    # pipeline schedule
    pp1_only = {"time/draft_train_s", "time/frozen_draft_s"}
    for r1, r2 in zip(rows["pp1"], rows["pp2"], strict=True):
        assert r2.keys() == r1.keys() - pp1_only and pp1_only <= r1.keys()
        assert r2["loss/policy"] is not None and r2["loss/draft"] is not None
    ckpt = tmp_path / "pp2" / "checkpoints"
    assert (ckpt / (ckpt / "latest").read_text() / "policy.safetensors").is_file()


def _dp_matches_single(rank: int, world_size: int, draft: list[str], run_dir: str):
    cfg = load_config(None, [*TINY, *draft, f"run.dir={run_dir}", f"parallel.dp={world_size}"])
    single = Trainer(cfg, run_dir, ParallelDims.single())
    dp = Trainer(cfg, run_dir)
    reference = captured_update(single, single.policy)
    rollout, rows, advantages, keep = fixed_rollout(dp.policy.args.vocab_size)
    mine = slice(2 * rank, 2 * rank + 2)  # this replica's group of the same prompts
    part = SimpleNamespace(tokens=rollout.tokens[mine], logprobs=rollout.logprobs[mine])
    return reference, captured_update(dp, dp.policy, (part, rows[mine], advantages[mine], keep[mine]))


@pytest.mark.filterwarnings(r"ignore:Seems like `optimizer.step\(\)`")
@pytest.mark.parametrize("draft", [["draft.family=none"], EAGLE3_EXACT], ids=["no-draft", "eagle3"])
def test_plain_dp2_update_matches_the_single_process_update_on_the_same_prompts(tmp_path, draft):
    """Two replicas, each on one group of the four sequences, sum their share-weighted gradients: the update of
    one process on all four."""
    for (m1, g1), (m2, g2) in run_workers(_dp_matches_single, 2, draft, str(tmp_path), timeout=120):
        assert g2.keys() == g1.keys()
        for name in g1:
            torch.testing.assert_close(torch.from_numpy(g2[name]), torch.from_numpy(g1[name]), rtol=1e-4, atol=1e-5,
                                       msg=name)
        for key in ("loss/policy", "loss/draft", "grad_norm/policy", "grad_norm/draft", "entropy"):
            assert (key in m1) == (key in m2), key
            if key in m1:
                assert m2[key] == pytest.approx(m1[key], rel=1e-5, abs=1e-6), key


def test_pp_degree_not_matching_the_world_fails_on_every_rank(tmp_path):
    overrides = [*TINY, "draft.family=none", "parallel.pp=3", f"run.dir={tmp_path}"]
    assert run_workers(_train, 2, overrides, timeout=60) == [2, 2]


def test_dp2_pp2_replicas_train_on_their_own_prompts_and_keep_one_set_of_weights(tmp_path):
    results = run_workers(_two_steps_then_weights, 4, str(tmp_path), 2, timeout=180)
    _, weights, metrics = results[0]
    for _, other, other_metrics in results[1:]:
        for name, w in weights.items():
            np.testing.assert_array_equal(w, other[name], err_msg=name)
        for m, o in zip(metrics, other_metrics, strict=True):  # averaged over the replicas: the same everywhere
            assert {k: v for k, v in o.items() if not k.startswith("time/")} == pytest.approx(
                {k: v for k, v in m.items() if not k.startswith("time/")}, rel=1e-6)


def test_replicas_split_every_draw_of_the_prompts():
    cfg = load_config(None, TINY)
    whole, replicas = build_task(cfg), [ReplicaTask(build_task(cfg), r, 2) for r in range(2)]
    for _ in range(2):
        assert whole.sample(6) == replicas[0].sample(3) + replicas[1].sample(3)
    assert replicas[1].state_dict() == whole.state_dict()


def test_pp2_resume_continues_exactly_like_an_uninterrupted_run(tmp_path):
    """Each stage's optimizer state goes through the checkpoint: steps 3-4 after a resume are steps 3-4 of one run."""
    from tests.train.test_trainer import deterministic, run_metrics

    common = [*TINY, *EAGLE3_EXACT, "parallel.pp=2", "rl.optimizer_steps_per_batch=2"]
    full, part = tmp_path / "full", tmp_path / "part"
    assert run_workers(_train, 2, [*common, "rl.steps=4", f"run.dir={full}"], timeout=180) == [0, 0]
    assert run_workers(_train, 2, [*common, "rl.steps=2", f"run.dir={part}"], timeout=180) == [0, 0]
    assert run_workers(_resume_with, 2, str(part), ["rl.steps=4"], timeout=180) == [0, 0]
    a, b = run_metrics(full), run_metrics(part)
    assert [m["step"] for m in b] == [1, 2, 3, 4]
    for x, y in zip(a, b, strict=True):
        assert deterministic(x) == pytest.approx(deterministic(y), rel=0, abs=0, nan_ok=True)
    ckpt = part / "checkpoints" / "step_000004"
    assert sorted(p.name for p in ckpt.glob("*.optim.pt")) == ["draft.optim.pt", "policy_stage0.optim.pt",
                                                               "policy_stage1.optim.pt"]


def test_a_pipeline_checkpoint_resumes_only_with_its_pp(tmp_path, capsys):
    common = [*TINY, "draft.family=none", "rl.steps=1", "checkpoint.keep=1"]
    assert run_workers(_train, 2, [*common, "parallel.pp=2", f"run.dir={tmp_path / 'pp2'}"], timeout=120) == [0, 0]
    assert main(["train", "--resume", str(tmp_path / "pp2"), "rl.steps=2", "parallel.pp=1"]) == 2
    err = capsys.readouterr().err
    assert "optimizer states of a pipeline of parallel.pp=2; resume it with parallel.pp=2" in err
    assert main(["train", *common, f"run.dir={tmp_path / 'pp1'}"]) == 0
    assert run_workers(_resume_with, 2, str(tmp_path / "pp1"), ["rl.steps=2", "parallel.pp=2"], timeout=120) == [2, 2]


def _resume_with(rank: int, world_size: int, run_dir: str, overrides: list[str]) -> int:
    return main(["train", "--resume", run_dir, *overrides])


def _pp_cp_matches_single(rank: int, world_size: int, draft: list[str], run_dir: str):
    cfg = load_config(None, [*TINY, *draft, f"run.dir={run_dir}", "parallel.pp=2", "parallel.cp=2"])
    single = Trainer(cfg, run_dir, ParallelDims.single())
    pp = Trainer(cfg, run_dir)
    torch.manual_seed(1)
    reference = captured_update(single, single.policy)
    torch.manual_seed(1)  # DFlash anchors: the same draw on every rank
    return reference, captured_update(pp, pp.stage), pp.dims.coords(rank)


@pytest.mark.filterwarnings(r"ignore:Seems like `optimizer.step\(\)`")
@pytest.mark.parametrize("draft", [EAGLE3_EXACT, [*EAGLE3_EXACT, "model.path=tiny-qwen3"]],
                         ids=["eagle3", "eagle3-untied-head"])
def test_pp2_cp2_update_matches_pp1_loss_and_all_gradients(tmp_path, draft):
    """Two pipelines of two stages, each stage a CP group of two (ring attention, zigzag microbatches, taps over
    each CP rank's own TapChannel): the update is the single-process one. (DFlash/DSpark draw anchors per
    microbatch under PP, so their loss equals pp = 1 only in expectation: see train/objective.py.)"""
    results = run_workers(_pp_cp_matches_single, 4, draft, str(tmp_path), timeout=180)
    assert [c for _, _, c in results] == [{"dp": 0, "pp": p, "cp": c} for p in (0, 1) for c in (0, 1)]
    (m1, g1), _, _ = results[0]
    seen = set()
    for (_, (m2, g2), coords) in results:
        for key in ("loss/policy", "loss/draft", "grad_norm/policy", "grad_norm/draft", "entropy"):
            assert m2[key] == pytest.approx(m1[key], rel=1e-5, abs=1e-6), (coords, key)
        for name, g in g2.items():
            ref = name if name in g1 else "policy.embed_tokens.weight"  # the last stage's copy of a tied head
            torch.testing.assert_close(torch.from_numpy(g), torch.from_numpy(g1[ref]), rtol=1e-4, atol=1e-5,
                                       msg=lambda m, name=name, coords=coords: f"{coords} {name}: {m}")
            seen.add(ref)
    assert seen == g1.keys()
