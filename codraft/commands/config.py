"""`codraft config [--command NAME]`: the resolved config (defaults, --config file, overrides) as YAML."""

from __future__ import annotations

import sys

import yaml

from codraft.config import Config, config_to_dict


def main(cfg: Config, sections: tuple[str, ...]) -> int:
    resolved = config_to_dict(cfg)
    sys.stdout.write(yaml.safe_dump({s: resolved[s] for s in sections}, sort_keys=False))
    return 0
