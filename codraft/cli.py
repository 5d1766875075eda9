"""``codraft <command> [--config file.yaml] [key=value ...]``.

Commands live in one table and are imported only when they run, so ``codraft --help`` stays fast.
A command is a function ``fn(cfg: Config) -> int | None``.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from codraft.config import ConfigError, load_config
from codraft.observability import setup_logging

# name -> (help, "module:function")
COMMANDS: dict[str, tuple[str, str]] = {
    "generate": ("generate completions (plain or speculative decoding)", "codraft.commands.generate:main"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="codraft",
        description="GRPO post-training with speculative rollouts and an online co-trained draft.",
    )
    commands = parser.add_subparsers(dest="command", metavar="<command>", required=True)
    for name, (help_text, _) in COMMANDS.items():
        sub = commands.add_parser(name, help=help_text, description=help_text)
        sub.add_argument("--config", metavar="FILE.yaml", help="YAML config, applied before the overrides")
        sub.add_argument("overrides", nargs="*", metavar="key=value", help="e.g. generate.temperature=0.7")
    return parser


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
    try:
        cfg = load_config(args.config, args.overrides + rest)
        setup_logging(cfg.run.log_level)
        return getattr(importlib.import_module(module), function)(cfg) or 0
    except ConfigError as e:
        print(f"codraft: error: {e}", file=sys.stderr)
        return 2
