"""`codraft export-draft`: from a train run dir and a draft-train dir; the export loads back to identical proposals."""

import json

import pytest
import torch

from codraft.cli import main
from codraft.config import load_config
from codraft.drafts import build_draft
from codraft.drafts.export import exported_trained_on, load_draft
from codraft.models import load_policy
from codraft.rollout import generate
from codraft.train.checkpoint import load_checkpoint

TINY_TRAIN = ["model.path=tiny-llama", "checkpoint.draft_init=none", "rl.prompts_per_step=2", "rl.group_size=2",
              "rl.max_new_tokens=6", "rl.steps=1", "rl.adaptive=false", "draft.num_anchors=2",
              "draft.draft_vocab_size=64", "run.tensorboard=false"]
TINY_DRAFT_TRAIN = ["model.path=tiny-llama", "run.tensorboard=false", "draft_train.num_prompts=8",
                    "draft_train.held_out_prompts=2", "draft_train.steps=2", "draft_train.batch_size=4",
                    "draft_train.max_new_tokens=8", "draft_train.eval_max_new_tokens=6", "draft.draft_vocab_size=64",
                    "draft.num_anchors=2"]


def rollout_with(policy, draft):
    torch.manual_seed(0)
    prompts = [torch.randint(0, 250, (n,)).tolist() for n in (5, 9)]
    return generate(policy, prompts, drafter=draft.drafter(), num_speculative_tokens=7, temperature=1.0,
                    max_new_tokens=12, seed=3, stop_token_ids=[])


def assert_same_draft(policy, original, exported):
    a, b = original.state_dict(), exported.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[name], b[name]) for name in a)
    x, y = rollout_with(policy, original), rollout_with(policy, exported)
    assert x.tokens == y.tokens
    assert x.stats.accepted_per_position == y.stats.accepted_per_position
    assert x.stats.draft_tokens_proposed == y.stats.draft_tokens_proposed > 0


@pytest.mark.parametrize("family", ["eagle3", "dflash", "dspark"])
def test_export_from_a_train_run_loads_back_to_identical_proposals(tmp_path, family):
    run = tmp_path / "run"
    assert main(["train", *TINY_TRAIN, f"draft.family={family}", f"run.dir={run}"]) == 0
    assert main(["export-draft", f"export.source={run}"]) == 0
    config = json.loads((run / "export" / "config.json").read_text())
    assert config["codraft_family"] == family and "codraft_trained_on" not in config  # it learned from rollouts too
    run_cfg = load_config(run / "config.yaml", [])
    policy, tokenizer = load_policy(run_cfg)
    original = build_draft(run_cfg.draft, policy, tokenizer)
    original.load_state_dict(load_checkpoint(run)["tensors"]["draft"])
    assert_same_draft(policy, original, load_draft(run / "export", policy))


def test_export_of_a_draft_train_run_and_of_a_draft_dir_load_back_identically(tmp_path):
    run, out, again = tmp_path / "run", tmp_path / "out", tmp_path / "again"
    assert main(["draft-train", *TINY_DRAFT_TRAIN, f"run.dir={run}"]) == 0
    assert main(["export-draft", f"export.source={run}", f"export.out_dir={out}", "export.family=eagle3"]) == 0
    assert json.loads((out / "config.json").read_text())["architectures"] == ["LlamaForCausalLMEagle3"]
    assert main(["export-draft", "model.path=tiny-llama", f"export.source={out}", f"export.out_dir={again}"]) == 0
    policy, _ = load_policy(load_config(None, ["model.path=tiny-llama"]))
    original = load_draft(run / "draft", policy)
    assert_same_draft(policy, original, load_draft(out, policy))
    assert_same_draft(policy, original, load_draft(again, policy))
    recorded = exported_trained_on(run / "draft")
    assert recorded["num_prompts"] == 8 and exported_trained_on(out) == exported_trained_on(again) == recorded


def test_export_errors_are_one_line_with_exit_code_2(tmp_path, capsys):
    def error(*args: str) -> str:
        assert main(["export-draft", *args]) == 2
        err = capsys.readouterr().err
        assert err.startswith("codraft: error: ") and err.count("\n") == 1
        return err

    assert "export.source: '" in error(f"export.source={tmp_path / 'missing'}")
    assert "export.source is required" in error()
    assert "is neither a run dir" in error(f"export.source={tmp_path}")
    assert "config key 'export.family' must be one of: any, eagle3" in error("export.family=medusa")
    run = tmp_path / "run"
    assert main(["draft-train", *TINY_DRAFT_TRAIN, "draft_train.steps=1", f"run.dir={run}"]) == 0
    capsys.readouterr()
    assert "holds a eagle3 draft but export.family=dflash" in error(f"export.source={run}", "export.family=dflash")
    assert "export.out_dir is required" in error(f"export.source={run / 'draft'}")
