"""The co-training step under context parallelism: cp=2 gives the cp=1 loss and gradients, end to end."""

import json
from types import SimpleNamespace

import pytest
import torch

from codraft.cli import main
from codraft.config import load_config
from codraft.parallel.collectives import reduce_gradients
from codraft.parallel.mesh import ParallelDims
from codraft.rl.batch import pack_rollouts
from codraft.train.trainer import Trainer
from tests.distributed import run_workers

TINY = [
    "model.path=tiny-llama",
    "checkpoint.draft_init=none",
    "rl.prompts_per_step=2",
    "rl.group_size=2",
    "rl.max_new_tokens=6",
    "task.max_operand=9",
    "run.tensorboard=false",
    "rl.adaptive=false",
    "rl.draft_weight=1.0",
    "rl.draft_matmul_dtype=float32",  # under bf16 autocast a layout's shards round differently
    "draft.num_anchors=3",
    "draft.block_size=4",
    "task.reward=tests.train.test_trainer:length_reward",
]


def fixed_rollout(vocab: int):
    """Four hand-made sequences of odd and even lengths (zigzag pads some), two groups of two."""
    g = torch.Generator().manual_seed(0)
    prompt_lens, completion_lens = [5, 7, 4, 9], [12, 9, 14, 11]
    rows = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in prompt_lens]
    tokens = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in completion_lens]
    logprobs = [(-torch.rand(n, generator=g) * 3).tolist() for n in completion_lens]
    rollout = SimpleNamespace(tokens=tokens, logprobs=logprobs)
    return rollout, rows, torch.tensor([1.0, -1.0, 0.5, -0.5]), torch.ones(4, dtype=torch.bool)


def one_update(trainer: Trainer) -> tuple[dict, dict]:
    """Metrics and the gradients the optimizers would apply (numpy: tensors do not outlive a worker),
    of one update on the fixed rollout."""
    grads = {}
    for name, opt, module in (("policy", trainer.policy_opt, trainer.policy), ("draft", trainer.draft_opt,
                                                                                 trainer.draft)):
        if opt is not None:
            opt.step = lambda name=name, module=module: grads.update(
                {f"{name}.{n}": p.grad.numpy().copy() for n, p in module.named_parameters() if p.grad is not None}
            )
    torch.manual_seed(1)  # DFlash anchors
    metrics = trainer._update(*fixed_rollout(trainer.policy.args.vocab_size))
    return metrics, grads


def _cp_matches_single(rank: int, world_size: int, family: str, run_dir: str):
    cfg = load_config(None, [*TINY, f"draft.family={family}", f"run.dir={run_dir}", f"parallel.cp={world_size}"])
    single = one_update(Trainer(cfg, run_dir, ParallelDims.single()))
    cp = one_update(Trainer(cfg, run_dir))
    return single, cp


@pytest.mark.filterwarnings(r"ignore:Seems like `optimizer.step\(\)`")
@pytest.mark.parametrize("family", ["none", "eagle3", "dflash", "dspark"])
def test_cp2_update_matches_cp1_loss_and_all_gradients(tmp_path, family):
    results = run_workers(_cp_matches_single, 2, family, str(tmp_path), timeout=90)
    for (m1, g1), (m2, g2) in results:
        assert g1.keys() == g2.keys() and any(k.startswith("policy.") for k in g1)
        assert (family == "none") != any(k.startswith("draft.") for k in g1)
        for name in g1:
            torch.testing.assert_close(torch.from_numpy(g2[name]), torch.from_numpy(g1[name]), rtol=1e-4, atol=1e-5,
                                       msg=name)
        for key in ("loss/policy", "loss/draft", "grad_norm/policy", "grad_norm/draft", "entropy"):
            if key in m1:
                assert m2[key] == pytest.approx(m1[key], rel=1e-5, abs=1e-6), key
    assert results[0][1][1].keys() == results[1][1][1].keys()  # both ranks stepped the same weights


def _train(rank: int, world_size: int, overrides: list[str]) -> int:
    return main(["train", *overrides])


def test_codraft_train_cp2_runs_and_rank0_writes_metrics(tmp_path):
    overrides = [*TINY, "draft.family=eagle3", "rl.steps=2", "parallel.cp=2", f"run.dir={tmp_path}"]
    assert run_workers(_train, 2, overrides, timeout=120) == [0, 0]
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]  # one writer
    assert all(r["loss/draft"] is not None and r["loss/policy"] is not None for r in rows)


def test_cp_degree_not_matching_the_world_fails_on_every_rank(tmp_path):
    overrides = [*TINY, "draft.family=none", "parallel.cp=3", f"run.dir={tmp_path}"]
    assert run_workers(_train, 2, overrides, timeout=60) == [2, 2]


def _dflash_loss_anchors_on_one_rank(rank: int, world_size: int, run_dir: str):
    cfg = load_config(None, [*TINY, "draft.family=dflash", f"run.dir={run_dir}", f"parallel.cp={world_size}"])
    results = []
    for dims in (ParallelDims.single(), None):  # one device, then CP
        trainer = Trainer(cfg, run_dir, dims)
        rollout, rows, _, _ = fixed_rollout(trainer.policy.args.vocab_size)
        view = trainer.view(pack_rollouts(rows, rollout.tokens, rollout.logprobs))
        out = trainer.policy(view.input_ids[None], cu_seqlens=view.cu_seqlens, positions=view.positions[None],
                             taps=trainer.draft.tap_layers)
        batch = view.draft_batch({i: t[0] for i, t in out.taps.items()}, out.logits[0])
        # sequence 0 (17 tokens) is cut in chunks of 5 for cp=2: both anchors lie in chunk 1, rank 1's
        loss, _ = trainer.draft.loss(batch, anchors=torch.tensor([6, 9]))
        loss.backward()
        reduce_gradients([trainer.draft], trainer.dims)
        results.append((loss.item(), {n: p.grad.numpy().copy() for n, p in trainer.draft.named_parameters()}))
    return results


def test_dflash_loss_with_a_rank_that_owns_no_anchor(tmp_path):
    for (l1, g1), (l2, g2) in run_workers(_dflash_loss_anchors_on_one_rank, 2, str(tmp_path), timeout=90):
        assert l2 == pytest.approx(l1, rel=1e-5)
        for name in g1:
            torch.testing.assert_close(torch.from_numpy(g2[name]), torch.from_numpy(g1[name]), rtol=1e-4, atol=1e-5)
