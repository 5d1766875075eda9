"""``codraft <command> [--config file.yaml] [key=value ...]``.

Commands live in one table and are imported only when they run, so ``codraft --help`` stays fast.
A command is a function ``fn(cfg: Config) -> int | None``.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import sys
import traceback
from pathlib import Path

from codraft.config import Config, ConfigError, load_config
from codraft.config_help import config_reference
from codraft.host_memory import keep_freed_memory
from codraft.observability import setup_logging

# name -> (help, "module:function")
COMMANDS: dict[str, tuple[str, str]] = {
    "generate": ("generate completions (plain or speculative decoding)", "codraft.commands.generate:main"),
    "train": ("GRPO post-training with an online co-trained draft", "codraft.commands.train:main"),
    "bench": ("run a benchmark: writes results/<name>.json, a Markdown table and plots", "codraft.commands.bench:main"),
    "draft-train": ("warm-start a draft by distillation on the policy's own responses",
                    "codraft.commands.draft_train:main"),
    "export-draft": ("export a trained draft in the layout SGLang/vLLM (EAGLE-3) or DFlash/DSpark load",
                     "codraft.commands.export_draft:main"),
    "config": ("print the resolved config as YAML (every section, or those of --command)",
               "codraft.commands.config:main"),
}
# the config sections each command reads, listed by its --help; a command not named here reads them all
TRAIN_SECTIONS = ("run", "model", "parallel", "draft", "task", "rl", "optim", "checkpoint")
SECTIONS: dict[str, tuple[str, ...]] = {
    "generate": ("run", "model", "generate"),
    "train": TRAIN_SECTIONS,
    "bench": (*TRAIN_SECTIONS, "bench", "draft_train"),  # bench e2e trains, bench draft distils
    "draft-train": ("run", "model", "draft", "task", "draft_train"),
    "export-draft": ("run", "model", "export"),
}
# commands that take one positional choice, mapped onto a config key
POSITIONALS: dict[str, tuple[str, tuple[str, ...]]] = {
    "bench": ("bench.benchmark", ("rollout", "attention", "draft", "e2e", "tapchannel", "soak")),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="codraft",
        description="GRPO post-training with speculative rollouts and an online co-trained draft.",
    )
    commands = parser.add_subparsers(dest="command", metavar="<command>", required=True)
    for name, (help_text, _) in COMMANDS.items():
        sub = commands.add_parser(name, help=help_text, description=help_text, epilog=config_reference(sections(name)),
                                  formatter_class=argparse.RawDescriptionHelpFormatter)
        if name in POSITIONALS:
            key, choices = POSITIONALS[name]
            sub.add_argument("positional", choices=choices, metavar="{" + ",".join(choices) + "}", help=key)
        if name == "train":
            sub.add_argument("--resume", metavar="RUN_DIR", help="continue a run from its latest checkpoint")
        if name == "config":
            sub.add_argument("--command", dest="for_command", choices=list(SECTIONS),
                             help="print only the sections this command reads")
        sub.add_argument("--config", metavar="FILE.yaml", help="YAML config, applied before the overrides")
        sub.add_argument("--debug", action="store_true", help="show the traceback of an error (as run.log_level=debug)")
        sub.add_argument("overrides", nargs="*", metavar="key=value", help="e.g. generate.temperature=0.7")
    return parser


def sections(command: str | None) -> tuple[str, ...]:
    return SECTIONS.get(command, tuple(f.name for f in dataclasses.fields(Config)))


def resume_config(run_dir: str) -> str:
    path = Path(run_dir) / "config.yaml"
    if not path.is_file():
        raise ConfigError(f"--resume {run_dir}: no config.yaml there; is it a codraft run directory?")
    return str(path)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        # parse_known_args lets overrides sit on both sides of --config
        args, rest = parser.parse_known_args(argv)
        flags = [arg for arg in rest if arg.startswith("-")]
        if flags:
            parser.error(f"unrecognized arguments: {' '.join(flags)}")
    except SystemExit as e:  # --help or a usage error, already printed by argparse
        return int(e.code or 0)
    module, function = COMMANDS[args.command][1].split(":")
    cfg = None
    try:
        overrides = args.overrides + rest
        if args.command in POSITIONALS:
            overrides.append(f"{POSITIONALS[args.command][0]}={args.positional}")
        config_file = args.config
        if getattr(args, "resume", None):  # the run's own resolved config, then the overrides
            config_file = config_file or resume_config(args.resume)
            overrides += [f"checkpoint.resume={args.resume}", f"run.dir={args.resume}"]
        cfg = load_config(config_file, overrides)
        setup_logging(cfg.run.log_level)
        if cfg.run.host_memory == "keep":  # process-wide, before the command allocates anything large
            keep_freed_memory()
        run = getattr(importlib.import_module(module), function)
        if args.command == "config":
            return run(cfg, sections(args.for_command))
        return run(cfg) or 0
    except ConfigError as e:
        return user_error(e, args.debug or (cfg is not None and cfg.run.log_level == "debug"))
    except KeyboardInterrupt as e:  # Ctrl-C outside a training loop, or a second signal inside one
        if args.debug:
            traceback.print_exception(e)
        print("codraft: interrupted", file=sys.stderr)
        return getattr(e, "exit_code", 130)


def user_error(e: ConfigError, debug: bool) -> int:
    """One line on stderr, the traceback only when debugging; exit code 2 (or the error's own `exit_code`: 1 for a
    rank that timed out waiting for another)."""
    if debug:
        traceback.print_exception(e)
    print(f"codraft: error: {' '.join(str(e).splitlines())}", file=sys.stderr)
    return getattr(e, "exit_code", 2)
