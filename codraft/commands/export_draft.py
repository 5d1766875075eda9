"""`codraft export-draft`: write a trained draft in the layout serving engines load.

`export.source` is one of
  a `codraft train` run dir          its latest checkpoint's draft weights, rebuilt from the run's config.yaml
  a `codraft draft-train` run dir    its `draft/`, for the policy of the run's config.yaml
  an exported draft dir              re-exported, for the policy of `model.*`
EAGLE-3 goes out as SGLang/vLLM's `LlamaForCausalLMEagle3`, DFlash/DSpark in the layout documented in
codraft/drafts/dflash.py; `export.out_dir` defaults to `<source>/export` for run dirs.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from safetensors.torch import load_file

from codraft.config import Config, ConfigError, load_config
from codraft.drafts import DraftModel, build_draft
from codraft.drafts.export import CONFIG_FILE, check_family, export_draft, exported_trained_on, is_draft_dir, read_draft
from codraft.models import load_policy
from codraft.train.checkpoint import latest_checkpoint

log = logging.getLogger(__name__)


def main(cfg: Config) -> int:
    e = cfg.export
    if e.source is None:
        raise ConfigError("export.source is required: a `codraft train` run dir, a `codraft draft-train` run dir "
                          "or an exported draft dir")
    source = Path(e.source)
    if e.out_dir is None and is_draft_dir(source):
        raise ConfigError("export.out_dir is required when export.source is an exported draft dir")
    draft, trained_on = load_source(source, cfg)
    if e.family != "any":
        check_family(draft, "export.source", "export.family", e.family)
    out = export_draft(draft, Path(e.out_dir) if e.out_dir is not None else source / "export", trained_on)
    log.info("exported the %s draft of %s to %s", draft.family, source, out)
    return 0


def load_source(source: Path, cfg: Config) -> tuple[DraftModel, dict | None]:
    """The source's draft and the prompts it records it was distilled on, kept in the export (a train run's draft
    records none: it went on learning from the run's rollouts)."""
    if is_draft_dir(source):
        return load_exported(source, cfg), exported_trained_on(source)
    if is_draft_dir(source / "draft"):
        return load_exported(source / "draft", run_config(source)), exported_trained_on(source / "draft")
    if (source / "checkpoints").is_dir():
        return load_train_run(source, run_config(source)), None
    raise ConfigError(f"export.source: '{source}' is neither a run dir (with checkpoints/ or draft/) "
                      f"nor an exported draft dir (with {CONFIG_FILE})")


def run_config(run_dir: Path) -> Config:
    path = run_dir / "config.yaml"
    if not path.is_file():
        raise ConfigError(f"export.source: '{run_dir}' has no config.yaml; is it a codraft run directory?")
    return load_config(path, [])


def load_exported(path: Path, cfg: Config) -> DraftModel:
    policy, _ = load_policy(cfg)
    return read_draft(path, policy, "export.source")


def load_train_run(run_dir: Path, run_cfg: Config) -> DraftModel:
    """The draft of the run's newest checkpoint, rebuilt as the run built it (fresh, or from draft_init)."""
    if run_cfg.draft.family == "none":
        raise ConfigError(f"export.source: the run '{run_dir}' trained no draft (draft.family=none)")
    try:
        path = latest_checkpoint(run_dir)  # only its draft weights are read, not the policy or optimizer states
    except FileNotFoundError as err:
        raise ConfigError(f"export.source: {err}") from None
    if not (path / "draft.safetensors").is_file():
        raise ConfigError(f"export.source: checkpoint {path} holds no draft weights")
    policy, tokenizer = load_policy(run_cfg)
    init = run_cfg.checkpoint.draft_init
    init = None if init == "auto" else init  # a cached draft was distilled with run_cfg.draft: fresh has its shapes
    draft = (read_draft(init, policy, "checkpoint.draft_init", run_cfg.draft.inference_dtype) if init is not None
             else build_draft(run_cfg.draft, policy, tokenizer))
    draft.load_state_dict(load_file(str(path / "draft.safetensors")))
    log.info("draft of %s at step %d", run_dir, json.loads((path / "meta.json").read_text())["step"])
    return draft
