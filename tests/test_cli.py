import logging
import re
import subprocess
import sys

import pytest
import yaml

from codraft import cli
from codraft.config import Config, ConfigError, load_config

CALLS: list[Config] = []


def echo(cfg: Config) -> int:
    """A stand-in command: records its config."""
    CALLS.append(cfg)
    return 0 if cfg.generate.drafter == "none" else 3


def fail(cfg: Config) -> None:
    raise ConfigError("model.path: 'x' is not a checkpoint")


@pytest.fixture
def commands(monkeypatch, tmp_path):
    CALLS.clear()
    monkeypatch.setattr(
        cli,
        "COMMANDS",
        {
            "echo": ("record the config", f"{__name__}:echo"),
            "fail": ("raise a config error", f"{__name__}:fail"),
        },
    )
    root, ours = logging.getLogger(), logging.getLogger("codraft")
    handlers, levels = root.handlers[:], (root.level, ours.level)
    (tmp_path / "config.json").write_text("{}")
    yield [f"model.path={tmp_path}"]  # an existing checkpoint dir: no preset lookup needed
    root.handlers[:] = handlers  # main() calls setup_logging
    root.setLevel(levels[0])
    ours.setLevel(levels[1])


def test_dispatch_passes_config_and_returns_command_code(commands, tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("generate:\n  top_k: 5\n")
    argv = ["echo", "generate.temperature=0.5", "--config", str(path), "parallel.dp=2", *commands]
    assert cli.main(argv) == 0
    (cfg,) = CALLS
    assert (cfg.generate.temperature, cfg.generate.top_k, cfg.parallel.dp) == (0.5, 5, 2)
    assert cli.main(["echo", "generate.drafter=ngram", *commands]) == 3


def test_config_error_is_one_line_and_exit_2(commands, capsys):
    assert cli.main(["echo", "generate.temprature=0.5", *commands]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.startswith("codraft: error: unknown config key 'generate.temprature'; valid keys in 'generate': ")
    assert err.count("\n") == 1 and "Traceback" not in err
    assert not CALLS


def test_config_error_raised_by_the_command(commands, capsys):
    assert cli.main(["fail", *commands]) == 2
    assert capsys.readouterr().err == "codraft: error: model.path: 'x' is not a checkpoint\n"


def test_help_and_usage_errors(commands, capsys):
    assert cli.main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "echo" in out and "record the config" in out
    assert cli.main(["nope"]) == 2
    assert "invalid choice: 'nope'" in capsys.readouterr().err
    assert cli.main(["echo", "--bogus", *commands]) == 2
    assert "unrecognized arguments: --bogus" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["--help"], ["train", "--help"]])
def test_help_imports_no_command_and_no_torch(argv):
    code = f"import sys, codraft.cli; codraft.cli.main({argv!r}); print('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().endswith("False")


def test_python_dash_m_entry_point():
    result = subprocess.run([sys.executable, "-m", "codraft", "--help"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and result.stdout.startswith("usage: codraft")


def help_of(command: str) -> str:
    result = subprocess.run([sys.executable, "-m", "codraft", command, "--help"], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stderr
    return result.stdout


def key_line(text: str, key: str) -> list[str]:
    """["type = default", comment] of the key's line (its columns are two or more spaces apart)."""
    (line,) = [line for line in text.splitlines() if line.split()[:1] == [key]]
    return re.split(r"\s{2,}", line.strip())[1:]


def test_train_help_lists_its_config_keys_with_types_defaults_and_comments():
    text = help_of("train")
    assert key_line(text, "rl.steps") == ["int = 50"]
    assert key_line(text, "rl.eps_high") == ["float = 0.28", "clip-higher"]
    every = key_line(text, "checkpoint.every")
    assert every[0] == "int = 10" and every[1].startswith("steps between checkpoints")
    assert key_line(text, "checkpoint.resume")[0] == "str | None = null"
    assert key_line(text, "rl.aggregation") == ["token-mean|sequence-mean|dr-grpo = token-mean"]
    listed = {line.split()[0] for line in text.splitlines() if line.startswith("    ")}
    assert "generate.temperature" not in listed and "bench.repeats" not in listed  # sections train does not read


def test_every_command_help_lists_the_keys_of_its_sections():
    assert key_line(help_of("generate"), "generate.temperature") == ["float = 1.0", "0 = greedy"]
    assert "draft_train.steps" in help_of("draft-train")
    assert "export.source" in help_of("export-draft")
    assert "bench.repeats" in help_of("bench") and "rl.steps" in help_of("bench")


def test_config_command_prints_the_resolved_config_as_yaml(capsys, tmp_path):
    assert cli.main(["config", "--command", "train", "rl.steps=3", "model.path=tiny-llama"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert tuple(printed) == cli.TRAIN_SECTIONS
    assert printed["rl"]["steps"] == 3 and printed["checkpoint"]["every"] == 10
    assert cli.main(["config", "model.path=tiny-llama"]) == 0
    path = tmp_path / "all.yaml"
    path.write_text(capsys.readouterr().out)
    assert load_config(path, []) == load_config(None, ["model.path=tiny-llama"])  # every section, round-trips
