"""`codraft bench draft`: acceptance and speedup of a draft, trained on the spot or loaded, in JSON and Markdown."""

import json
import logging

import pytest
import torch

from codraft.bench.draft import past_stop_share, past_training_prompts, prompt_groups, run_draft_bench, speed_runs
from codraft.bench.report import interleaved, median
from codraft.cli import main
from codraft.config import DraftConfig, load_config
from codraft.distill.distill import distillation_prompts
from codraft.drafts import build_draft
from codraft.drafts.export import export_draft, exported_trained_on
from codraft.models.linear import packed_dtype
from tests.rollout.conftest import tiny_model
from tests.rollout.test_engine import PROMPTS

TINY = ["model.path=tiny-llama", "run.tensorboard=false", "task.kind=arithmetic", "draft_train.num_prompts=8",
        "draft_train.steps=2", "draft_train.batch_size=4", "draft_train.max_new_tokens=8", "draft.draft_vocab_size=64",
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
    assert exported_trained_on(run / "draft") == distillation_prompts(load_config(None, TINY))
    assert training == {"draft_path": str(run / "draft"), "task": "arithmetic", "held_out_after": 8}
    capsys.readouterr()
    assert main(["bench", "draft", *TINY, f"bench.draft_path={run / 'draft'}", "draft.family=dspark"]) == 2
    assert "holds a eagle3 draft but draft.family=dspark" in capsys.readouterr().err


def test_bench_draft_holds_out_the_prompts_after_those_the_draft_was_distilled_on(tmp_path, caplog):
    """A draft distilled on the first 8 prompts of the stream is benched on prompts after them, not after the 4 of
    the bench's own draft_train.num_prompts; the record counts only for the same stream (task.*, run.seed)."""
    distilled = load_config(None, [*TINY, "draft_train.num_prompts=8"])
    draft = build_draft(DraftConfig(family="eagle3", draft_vocab_size=0), tiny_model())
    recorded = export_draft(draft, tmp_path / "recorded", distillation_prompts(distilled))
    unrecorded = export_draft(draft, tmp_path / "unrecorded")
    assert exported_trained_on(recorded)["num_prompts"] == 8 and exported_trained_on(unrecorded) is None

    bench = load_config(None, [*TINY, "draft_train.num_prompts=4"])
    assert past_training_prompts(bench, str(recorded)).draft_train.num_prompts == 8
    more = load_config(None, [*TINY, "draft_train.num_prompts=12"])
    assert past_training_prompts(more, str(recorded)).draft_train.num_prompts == 12
    for other in ("run.seed=1", "task.max_operand=5", "task.kind=chain"):  # another stream: other first 8 prompts
        other_stream = load_config(None, [*TINY, "draft_train.num_prompts=4", other])
        assert past_training_prompts(other_stream, str(recorded)).draft_train.num_prompts == 4
    for same in ("task.reward=final_answer", "task.chat_template=false", "task.chain_max_terms=6"):  # how, not which
        same_stream = load_config(None, [*TINY, "draft_train.num_prompts=4", same])
        assert past_training_prompts(same_stream, str(recorded)).draft_train.num_prompts == 8
    with caplog.at_level(logging.WARNING):
        assert past_training_prompts(bench, str(unrecorded)).draft_train.num_prompts == 4
    assert "does not record the prompts it was trained on" in caplog.text


def test_bench_draft_on_the_chain_task_with_stop_tokens(tmp_path):
    """Rows end at EOS as in RL rollouts: greedy outputs still identical, speedups from tokens per second."""
    assert main(["bench", "draft", *TINY, "task.kind=chain", "task.chain_max_terms=6", "bench.stop_tokens=true",
                 "bench.batch_sizes=[2]", f"bench.out_dir={tmp_path}"]) == 0
    result = json.loads((tmp_path / "draft_eagle3.json").read_text())
    assert result["stop_tokens"] and result["training"]["task"] == "chain"
    assert result["draft_matmuls"] == str(packed_dtype("auto", torch.float32)).removeprefix("torch.")
    (speed,) = result["speedup"]
    assert speed["greedy_tokens_identical"] and speed["spec_speedup_t0"] > 0
    tokens = speed["length_matched_tokens_t1"]
    assert tokens["spec"] == tokens["ar_matched"] > 0 and speed["spec_speedup_length_matched_t1"] > 0
    text = (tmp_path / "draft_eagle3.md").read_text()
    assert "held-out chain prompts" in text and "stop tokens on" in text and "Length-matched (T > 0)" in text
    assert f"(rollout matmuls {result['draft_matmuls']})" in text


def tiny_policy_and_draft():
    """A tiny policy that stops often (twelve of its 48 ids are EOS), so sampled rows end at many different lengths
    and hardly ever all reach the cap."""
    model = tiny_model(vocab_size=48, sharpen=3.0, tie_word_embeddings=False, eos_token_id=list(range(1, 13)))
    return model, build_draft(DraftConfig(family="eagle3", draft_vocab_size=0), model).eval()


def test_length_matched_plain_run_decodes_each_row_to_the_adaptive_runs_length():
    model, draft = tiny_policy_and_draft()
    runs = speed_runs(model, draft, prompt_groups(PROMPTS, 2), k=3, max_new_tokens=16, stop_tokens=True)
    assert "ar_matched_t1" in runs and "ar_matched_t0" not in runs
    times, outputs = interleaved(runs, repeats=2)
    spec, matched = outputs["spec_t1"], outputs["ar_matched_t1"]
    lengths = [len(t) for t in spec.tokens]
    assert [len(t) for t in matched.tokens] == lengths and len(set(lengths)) > 1
    assert "stop" in spec.finish_reasons and set(matched.finish_reasons) == {"length"}
    assert len(times["ar_matched_t1"]) == len(times["spec_t1"]) == 2


@pytest.mark.parametrize("stop_tokens", [True, False], ids=["stops-on", "stops-off"])
def test_bench_draft_reports_the_length_matched_speedup_in_json_and_table(tmp_path, stop_tokens):
    model, draft = tiny_policy_and_draft()
    run_draft_bench(model, draft, PROMPTS, k=3, batch_sizes=[2], max_new_tokens=16, repeats=2, out_dir=str(tmp_path),
                    training={}, stop_tokens=stop_tokens)
    (speed,) = json.loads((tmp_path / "draft_eagle3.json").read_text())["speedup"]
    text = (tmp_path / "draft_eagle3.md").read_text()
    header, *rows = [line.split(" | ") for line in text.splitlines() if line.startswith("| 2 |")
                     or line.startswith("| batch | T |")]
    column = header.index("adaptive speedup, length-matched")
    t0, t1 = rows
    assert t0[column] == "n/a" and "spec_speedup_length_matched_t0" not in speed
    past, rounds = header.index("AR tokens past EOS"), header.index("adaptive speedup, rounds")
    times = speed["times_s"]
    greedy = [a / s for a, s in zip(times["ar_t0"], times["spec_t0"], strict=True)]  # the same tokens every round
    assert speed["spec_speedup_rounds_t0"] == pytest.approx(greedy) and len(greedy) == 2
    assert t0[rounds] == f"{min(greedy):.3g}-{max(greedy):.3g}"
    sampled = times["ar_matched_t1" if stop_tokens else "ar_t1"]
    assert speed["spec_speedup_rounds_t1"] == pytest.approx([a / s for a, s in zip(sampled, times["spec_t1"],
                                                                                      strict=True)])
    if not stop_tokens:  # the tiny policy stops often: rows decoded on past their first EOS
        assert 0 < speed["past_stop_share_t0"] < 1 and t0[past] == f"{speed['past_stop_share_t0']:.3g}"
        assert "AR tokens past EOS: the share" in text
        assert t1[column] == "n/a" and "ar_matched_t1" not in speed["times_s"] and "Length-matched" not in text
        return
    assert "past_stop_share_t0" not in speed and t0[past] == t1[past] == "n/a"
    ratio = median([a / s for a, s in zip(speed["times_s"]["ar_matched_t1"], speed["times_s"]["spec_t1"],
                                          strict=True)])
    assert speed["spec_speedup_length_matched_t1"] == pytest.approx(ratio) and ratio > 0
    assert t1[column] == f"{ratio:.3g}" and "Length-matched (T > 0)" in text
    tokens = speed["length_matched_tokens_t1"]
    assert tokens["spec"] == tokens["ar_matched"] < 4 * 16  # some rows stopped early, and plain matched them
    assert tokens["ar_matched"] == pytest.approx(
        speed["tokens_per_s"]["ar_matched_t1"] * median(speed["times_s"]["ar_matched_t1"]))


def test_past_stop_share_counts_the_tokens_after_each_rows_first_stop_token():
    assert past_stop_share([[5, 2, 7, 2, 9], [1, 1, 1], [2]], stop_ids=[2]) == pytest.approx(3 / 9)
    assert past_stop_share([[5, 6]], stop_ids=[]) == 0


def test_bench_draft_reports_the_decode_phase_without_each_rounds_prefill(tmp_path):
    model, draft = tiny_policy_and_draft()
    run_draft_bench(model, draft, PROMPTS, k=3, batch_sizes=[2], max_new_tokens=16, repeats=2, out_dir=str(tmp_path),
                    training={})
    (speed,) = json.loads((tmp_path / "draft_eagle3.json").read_text())["speedup"]
    times, prefill = speed["times_s"], speed["prefill_s"]
    assert all(len(prefill[name]) == len(times[name]) == 2 for name in times)  # the warm-up call's is left out
    assert all(0 < p < t for name in times for p, t in zip(prefill[name], times[name], strict=True))
    decode = {name: [t - p for t, p in zip(times[name], prefill[name], strict=True)] for name in ("ar_t0", "spec_t0")}
    # stop tokens off: both runs emit the same tokens, so the speedup is the ratio of decode seconds
    assert speed["spec_speedup_decode_t0"] == pytest.approx(median(decode["ar_t0"]) / median(decode["spec_t0"]))
    assert speed["prefill_share_t0"] == pytest.approx(median(prefill["ar_t0"]) / median(times["ar_t0"]))
    header = next(line.split(" | ") for line in (tmp_path / "draft_eagle3.md").read_text().splitlines()
                  if line.startswith("| batch | T |"))
    assert "adaptive speedup, decode only" in header and "prefill share of AR time" in header
