"""Whether a run may continue a checkpoint, decided from its meta.json before anything is loaded or written."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from codraft.config import Config, ConfigError, config_to_dict
from codraft.train.checkpoint import META, latest_checkpoint, load_checkpoint

# sections a resumed run must share with the run it continues, but for the keys that may change: the step
# budget, and when to give up on a broken reward function
RESUME_SECTIONS = ("model", "draft", "task", "rl", "optim")
MAY_CHANGE = ("rl.steps", "rl.max_dropped_share", "rl.max_dropped_steps")


def resume_sections(cfg: Config) -> dict[str, Any]:
    """What a checkpoint stores of the config: the sections a resumed run must share."""
    return {k: v for k, v in config_to_dict(cfg).items() if k in RESUME_SECTIONS}


def check_resumable(cfg: Config, meta: dict[str, Any], path: Path) -> None:
    """ConfigError unless `cfg` may continue the checkpoint at `path`, whose meta.json is `meta`."""
    saved, now = meta["config"], resume_sections(cfg)
    diff = [key for s in RESUME_SECTIONS for k in saved.get(s, {})
            if (key := f"{s}.{k}") not in MAY_CHANGE and saved[s][k] != now[s].get(k)]
    if diff:
        raise ConfigError(f"checkpoint.resume: {path} was trained with a different config ({', '.join(diff)})")
    pp = meta.get("pipeline", {}).get("pp", 1)  # optimizer states are per pipeline stage
    if pp != cfg.parallel.pp:
        written = f"a pipeline of parallel.pp={pp}" if pp > 1 else "a run without pipeline parallelism"
        raise ConfigError(f"checkpoint.resume: {path} holds the optimizer states of {written}; resume it with "
                          f"parallel.pp={pp} (got parallel.pp={cfg.parallel.pp})")


def resumable_checkpoint(cfg: Config) -> Path:
    """The checkpoint that `checkpoint.resume` continues, checked against `cfg` (reads meta.json only)."""
    try:
        path = latest_checkpoint(Path(cfg.checkpoint.resume))
    except FileNotFoundError as e:
        raise ConfigError(f"checkpoint.resume: {e}") from None
    check_resumable(cfg, json.loads((path / META).read_text()), path)
    return path


def load_resumable(cfg: Config) -> dict[str, Any]:
    """`load_checkpoint` of `checkpoint.resume`, checked against `cfg` before the caller applies it."""
    try:
        ckpt = load_checkpoint(Path(cfg.checkpoint.resume))
    except FileNotFoundError as e:
        raise ConfigError(f"checkpoint.resume: {e}") from None
    check_resumable(cfg, ckpt["meta"], ckpt["path"])
    return ckpt
