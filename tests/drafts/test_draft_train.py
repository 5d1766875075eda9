"""`codraft draft-train`: each family trains on the policy's own responses, lowers its loss, writes its outputs."""

import json

import pytest

from codraft.cli import main

TINY = [
    "model.path=tiny-llama",
    "run.tensorboard=false",
    "task.max_operand=9",
    "draft_train.num_prompts=16",
    "draft_train.held_out_prompts=4",
    "draft_train.steps=12",
    "draft_train.batch_size=8",
    "draft_train.max_new_tokens=16",
    "draft_train.eval_max_new_tokens=12",
    "draft_train.warmup_steps=0",
    "draft_train.save_every=5",
    "draft.draft_vocab_size=64",
    "draft.num_anchors=4",
]


def read_jsonl(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.parametrize("family", ["eagle3", "dflash", "dspark"])
def test_draft_train_lowers_the_loss_and_writes_metrics_draft_and_eval(tmp_path, family):
    assert main(["draft-train", *TINY, f"draft.family={family}", f"run.dir={tmp_path}"]) == 0
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    train_rows, eval_row = rows[:-1], rows[-1]
    assert [r["step"] for r in train_rows] == list(range(1, 13))
    losses = [r["loss/draft"] for r in train_rows]
    assert sum(losses[-3:]) < sum(losses[:3])
    assert eval_row["eval/t0/acceptance_length"] >= 1 and eval_row["eval/t1/acceptance_length"] >= 1
    config = json.loads((tmp_path / "draft" / "config.json").read_text())
    assert config["codraft_family"] == family
    assert (tmp_path / "draft" / "model.safetensors").is_file()
    result = json.loads((tmp_path / "eval.json").read_text())
    assert result["k"] == 7 and result["prompts"] == 4 and result["family"] == family
    for temperature in ("temperature_0", "temperature_1"):
        assert 1 <= result[temperature]["tau"] <= 8
        assert len(result[temperature]["accept_rate_per_position"]) <= 7


def test_draft_train_on_a_jsonl_task(tmp_path):
    data = tmp_path / "task.jsonl"
    data.write_text("\n".join(json.dumps({"prompt": f"Say {i} twice.", "answer": f"{i} {i}"}) for i in range(30)))
    run = tmp_path / "run"
    args = ["draft-train", *TINY, "task.kind=jsonl", f"task.path={data}", "draft_train.steps=2", f"run.dir={run}"]
    assert main(args) == 0
    assert (run / "eval.json").is_file()


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("draft.family=none", "draft.family must be one of eagle3, dflash, dspark for draft-train"),
        ("draft_train.batch_size=0", "config key 'draft_train.batch_size' must be >= 1"),
        ("draft_train.lr=0", "config key 'draft_train.lr' must be > 0"),
    ],
)
def test_draft_train_rejects_bad_config_in_one_line(tmp_path, capsys, override, message):
    assert main(["draft-train", *TINY, override, f"run.dir={tmp_path}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("codraft: error: ") and message in err and err.count("\n") == 1
