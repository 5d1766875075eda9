"""`codraft bench draft`: acceptance and speedup of a draft, trained on the spot or loaded, in JSON and Markdown."""

import json

import pytest

from codraft.cli import main

TINY = ["model.path=tiny-llama", "run.tensorboard=false", "draft_train.num_prompts=8", "draft_train.steps=2",
        "draft_train.batch_size=4", "draft_train.max_new_tokens=8", "draft.draft_vocab_size=64",
        "draft.num_anchors=2", "bench.draft_prompts=3", "bench.batch_sizes=[1,2]", "bench.max_new_tokens=6",
        "bench.repeats=1"]


@pytest.mark.parametrize("family", ["eagle3", "dflash"])
def test_bench_draft_trains_a_draft_and_writes_acceptance_and_speedup(tmp_path, family):
    assert main(["bench", "draft", *TINY, f"draft.family={family}", f"bench.out_dir={tmp_path}"]) == 0
    result = json.loads((tmp_path / f"draft_{family}.json").read_text())
    assert result["k"] == 7 and result["training"]["steps"] == 2
    assert 1 <= result["acceptance"]["temperature_0"]["tau"] <= 8
    assert [r["batch"] for r in result["speedup"]] == [1, 2]
    assert all(r["greedy_tokens_identical"] and r["spec_speedup_t0"] > 0 and r["fixed_speedup_t1"] > 0
               for r in result["speedup"])
    assert "| batch |" in (tmp_path / f"draft_{family}.md").read_text()


def test_bench_draft_loads_a_draft_dir_and_checks_its_family(tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["draft-train", *TINY, "draft_train.held_out_prompts=1", "draft_train.eval_max_new_tokens=2",
                 f"run.dir={run}"]) == 0
    assert main(["bench", "draft", *TINY, f"bench.draft_path={run / 'draft'}", f"bench.out_dir={tmp_path}"]) == 0
    training = json.loads((tmp_path / "draft_eagle3.json").read_text())["training"]
    assert training == {"draft_path": str(run / "draft"), "task": "arithmetic"}
    capsys.readouterr()
    assert main(["bench", "draft", *TINY, f"bench.draft_path={run / 'draft'}", "draft.family=dspark"]) == 2
    assert "holds a eagle3 draft but draft.family=dspark" in capsys.readouterr().err


def test_bench_draft_on_the_chain_task_with_stop_tokens(tmp_path):
    """Rows end at EOS as in RL rollouts: greedy outputs still identical, speedups from tokens per second."""
    assert main(["bench", "draft", *TINY, "task.kind=chain", "task.chain_max_terms=6", "bench.stop_tokens=true",
                 "bench.batch_sizes=[2]", f"bench.out_dir={tmp_path}"]) == 0
    result = json.loads((tmp_path / "draft_eagle3.json").read_text())
    assert result["stop_tokens"] and result["training"]["task"] == "chain"
    (speed,) = result["speedup"]
    assert speed["greedy_tokens_identical"] and speed["spec_speedup_t0"] > 0
    text = (tmp_path / "draft_eagle3.md").read_text()
    assert "held-out chain prompts" in text and "stop tokens on" in text
