"""Every user error where input enters is one line `codraft: error: ...` on stderr, exit 2, no traceback (unless
--debug or run.log_level=debug), and leaves no run directory behind."""

import json
import subprocess
import sys

import pytest
import torch

from codraft.cli import main
from codraft.models.tokenizer import Tokenizer
from tests.train.test_trainer import TINY

ROW = json.dumps({"prompt": "What is 2 + 3?", "answer": "5"})


def train(tmp_path, *overrides):
    return main(["train", *TINY, "rl.steps=1", f"run.dir={tmp_path / 'run'}", *overrides])


def one_line_error(capsys, tmp_path) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err
    last = err.splitlines()[-1]
    assert last.startswith("codraft: error: ") and err.endswith(last + "\n")
    assert not (tmp_path / "run").exists()  # nothing written before the inputs were checked
    return last.removeprefix("codraft: error: ")


def recorded_encodes(monkeypatch) -> list[str]:
    """Every text the tokenizer encodes from now on."""
    texts, encode = [], Tokenizer.encode
    monkeypatch.setattr(Tokenizer, "encode", lambda self, text, **kw: texts.append(text) or encode(self, text, **kw))
    return texts


def jsonl(tmp_path, content: bytes | str) -> str:
    path = tmp_path / "data.jsonl"
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    return str(path)


@pytest.mark.parametrize(
    "content, message",
    [
        ("", "{path}: no problems (the file is empty)"),
        (f'{ROW}\n{{"prompt": "x"}}\n', "{path}:2: missing field 'answer'"),
        (f"{ROW}\nnot json\n", "{path}:2: not valid JSON (Expecting value)"),
        (f"{ROW}\n".encode() + b'{"prompt": "caf\xe9", "answer": "1"}\n', "{path}:2: not valid UTF-8 (byte 0xe9"),
    ],
    ids=["empty", "no-answer", "not-json", "not-utf8"],
)
def test_a_bad_jsonl_task_file_is_one_line_naming_file_and_line(tmp_path, capsys, content, message):
    path = jsonl(tmp_path, content)
    assert train(tmp_path, "task.kind=jsonl", f"task.path={path}") == 2
    assert one_line_error(capsys, tmp_path).startswith("task.path " + message.format(path=path))


@pytest.mark.parametrize("length, tokenised", [(3_000, 1), (10_000_000, 0)],
                         ids=["over-by-tokens", "10MB-refused-untokenised"])
def test_a_prompt_longer_than_the_context_is_refused_naming_its_row(tmp_path, capsys, monkeypatch, length, tokenised):
    path = jsonl(tmp_path, ROW + "\n" + json.dumps({"prompt": "1" * length, "answer": "1"}) + "\n")
    texts = recorded_encodes(monkeypatch)
    assert train(tmp_path, "task.kind=jsonl", f"task.path={path}", "rl.max_new_tokens=6") == 2
    message = one_line_error(capsys, tmp_path)
    # tiny-llama: 2048 positions less 6 new tokens, 4 speculative tokens and the bonus token
    assert message.startswith(f"task.path {path}:2: the prompt is ")
    assert "; at most 2037 fit (the policy's context of 2048 positions less 11 for the response" in message
    assert sum(len(t) >= length for t in texts) == tokenised  # before the draft vocabulary: once, or never at all


def test_building_the_draft_vocabulary_tokenises_each_prompt_once(tmp_path, monkeypatch):
    rows = [json.dumps({"prompt": f"What is {i} + 1?", "answer": str(i + 1)}) for i in range(3)]
    path = jsonl(tmp_path, "\n".join(rows) + "\n")
    texts = recorded_encodes(monkeypatch)
    from codraft.config import load_config
    from codraft.train.trainer import Trainer

    # drift off: its held-out prompts are tokenised on their own, not for the draft vocabulary
    cfg = load_config(None, [*TINY, "task.kind=jsonl", f"task.path={path}", "draft.family=eagle3", "rl.drift_every=0"])
    trainer = Trainer(cfg, None)  # 256 prompts sampled from 3 rows for the draft vocabulary
    assert len(texts) == 3 and len(set(texts)) == 3
    assert int(trainer.draft.t2d.sum()) > 0


def test_a_model_path_that_is_no_model_is_one_line(tmp_path, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    assert train(tmp_path, f"model.path={empty}") == 2
    assert "is a directory without config.json" in one_line_error(capsys, tmp_path)
    notes = tmp_path / "notes.txt"
    notes.write_text("not a model")
    assert train(tmp_path, f"model.path={notes}") == 2
    assert "is a file but not a .gguf model" in one_line_error(capsys, tmp_path)


def test_a_pickle_only_checkpoint_is_refused_in_one_line(tmp_path, capsys):
    ckpt = tmp_path / "pickled"
    ckpt.mkdir()
    config = {"architectures": ["LlamaForCausalLM"], "vocab_size": 300, "hidden_size": 64, "intermediate_size": 128,
              "num_hidden_layers": 2, "num_attention_heads": 4}
    (ckpt / "config.json").write_text(json.dumps(config))
    torch.save({"model.embed_tokens.weight": torch.zeros(1)}, ckpt / "pytorch_model.bin")
    assert train(tmp_path, f"model.path={ckpt}") == 2
    assert one_line_error(capsys, tmp_path).startswith(f"model.path: {ckpt} holds only pickled weights")
    (ckpt / "config.json").write_text("{")
    assert train(tmp_path, f"model.path={ckpt}") == 2
    assert one_line_error(capsys, tmp_path).startswith(f"model.path: {ckpt / 'config.json'} is not valid JSON")


def test_a_reward_function_that_cannot_load_is_one_line(tmp_path, capsys):
    assert train(tmp_path, "task.reward=no_such_module:fn") == 2
    assert one_line_error(capsys, tmp_path).startswith("task.reward: reward function 'no_such_module:fn'")


@pytest.mark.parametrize("debug", [["--debug"], ["run.log_level=debug"]], ids=["flag", "log-level"])
def test_debug_shows_the_traceback_before_the_line(tmp_path, debug):
    path = jsonl(tmp_path, "")
    cmd = [sys.executable, "-m", "codraft", "train", *TINY, f"run.dir={tmp_path / 'run'}", "task.kind=jsonl",
           f"task.path={path}"]
    plain = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert plain.returncode == 2 and "Traceback" not in plain.stderr
    assert plain.stderr.splitlines()[-1].startswith(f"codraft: error: task.path {path}: no problems")
    shown = subprocess.run([*cmd, *debug], capture_output=True, text=True, timeout=120)
    assert shown.returncode == 2 and "Traceback (most recent call last)" in shown.stderr
    assert shown.stderr.splitlines()[-1] == plain.stderr.splitlines()[-1]
    assert not (tmp_path / "run").exists()
