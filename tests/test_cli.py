import logging
import subprocess
import sys

import pytest

from codraft import cli
from codraft.config import Config, ConfigError

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


def test_help_imports_no_command_and_no_torch():
    code = "import sys, codraft.cli; codraft.cli.main(['--help']); print('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().endswith("False")


def test_python_dash_m_entry_point():
    result = subprocess.run([sys.executable, "-m", "codraft", "--help"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and result.stdout.startswith("usage: codraft")
