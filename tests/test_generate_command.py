import json

from codraft.cli import main


def test_generate_command_writes_completions_and_metrics(tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": p}) for p in ["hi there", "2+2=", "abc abc abc"]))
    run_dir = tmp_path / "run"
    rc = main(["generate", "model.path=tiny-llama", f"run.dir={run_dir}", f"generate.prompts_file={prompts}",
               "generate.max_new_tokens=6", "generate.drafter=ngram", "generate.batch_size=2",
               "generate.temperature=0"])
    assert rc == 0
    rows = [json.loads(line) for line in (run_dir / "generations.jsonl").read_text().splitlines()]
    assert [r["prompt"] for r in rows] == ["hi there", "2+2=", "abc abc abc"]
    assert all(1 <= r["num_tokens"] <= 6 for r in rows)
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(metrics) == 2 and "spec/acceptance_length" in metrics[0]
    assert (run_dir / "config.yaml").exists()


def test_generate_command_rejects_a_bad_prompts_file(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "no prompt field"}\n')
    rc = main(["generate", "model.path=tiny-llama", f"run.dir={tmp_path / 'r'}", f"generate.prompts_file={bad}"])
    assert rc == 2
    assert "bad.jsonl:1: needs a non-empty string 'prompt'" in capsys.readouterr().err


def test_generate_command_names_the_line_of_a_non_utf8_prompts_file(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(b'{"prompt": "ok"}\n{"prompt": "\xff"}\n')
    rc = main(["generate", "model.path=tiny-llama", f"run.dir={tmp_path / 'r'}", f"generate.prompts_file={bad}"])
    assert rc == 2
    err = capsys.readouterr().err  # the whole of it: no run dir was made, so not even its log line
    assert err == f"codraft: error: generate.prompts_file {bad}:2: not valid UTF-8 (byte 0xff at column 13)\n"
    assert not (tmp_path / "r").exists()
