"""Export a draft to a directory (config.json + model.safetensors) and load it back.

The directory is what a serving engine loads (EAGLE-3: SGLang/vLLM
`LlamaForCausalLMEagle3`), plus keys of codraft's own: `codraft_family`
(which class rebuilds it), `codraft_config` (the DraftConfig it was trained
with) and, for a distilled draft, `codraft_trained_on` (the task prompts it
learned from: distill.distillation_prompts). Configs written by other tools are
recognised by `architectures[0]`.

Contract for a draft family (register it with `register_family`):
    draft.export_config() -> dict
        config.json: every shape needed to rebuild the draft (and what the serving
        engine reads); JSON-serialisable.
    draft.export_state_dict() -> dict[str, Tensor]
        weights under the exported names; no borrowed policy weights.
    Family.from_export(config: dict, state: dict[str, Tensor], policy_args: ModelArgs) -> DraftModel
        a classmethod that rebuilds the draft (not attached) from the two above and loads
        the weights, e.g. with `load_checked`. `config["codraft_config"]` may be absent
        (another tool wrote the directory); `draft_config(config)` reads it. A config that
        does not fit `policy_args` raises ValueError naming the config field.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from codraft.config import DRAFT_FAMILIES, ConfigError, DraftConfig
from codraft.drafts.base import DraftModel
from codraft.models import ModelArgs, Transformer

log = logging.getLogger(__name__)

CONFIG_FILE, WEIGHTS_FILE = "config.json", "model.safetensors"
FAMILIES: dict[str, type[DraftModel]] = {}
ARCHITECTURES: dict[str, str] = {}  # architectures[0] of a config -> family name


def register_family(name: str, cls: type[DraftModel], architectures: tuple[str, ...] = ()) -> None:
    assert name in DRAFT_FAMILIES, f"{name}: a draft family is named in config.DRAFT_FAMILIES first"
    FAMILIES[name] = cls
    for arch in architectures:
        ARCHITECTURES[arch] = name


def export_draft(draft: DraftModel, out_dir: str | Path, trained_on: dict | None = None) -> Path:
    """Write `out_dir` atomically: built in a temporary sibling, then renamed into place
    (an existing directory is replaced; readers never see a half-written one). `trained_on`: the prompts a
    distilled draft learned from, kept as `codraft_trained_on`."""
    out = Path(out_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    config = draft.export_config() | {
        "codraft_family": draft.family,
        "codraft_config": dataclasses.asdict(draft.cfg),
    }
    if trained_on is not None:
        config["codraft_trained_on"] = trained_on
    state = {name: t.detach().cpu().contiguous() for name, t in draft.export_state_dict().items()}
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        (tmp / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
        save_file(state, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
        if out.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old.", dir=out.parent))
            out.rename(old / out.name)
            tmp.rename(out)
            shutil.rmtree(old)
        else:
            tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log.info("exported %s draft (%d tensors) to %s", draft.family, len(state), out)
    return out


def is_draft_dir(path: Path) -> bool:
    """An exported draft directory (it holds the config `load_draft` reads)."""
    return (path / CONFIG_FILE).is_file()


def check_family(draft: DraftModel, source_key: str, family_key: str, family: str) -> DraftModel:
    """`draft` when it is of `family` (the value of config key `family_key`), else a ConfigError naming both keys."""
    if draft.family != family:
        raise ConfigError(f"{source_key} holds a {draft.family} draft but {family_key}={family}")
    return draft


def exported_family(path: str | Path) -> str | None:
    """The draft family an exported draft directory holds, from its config (None: no known family named)."""
    config = json.loads((Path(path) / CONFIG_FILE).read_text())
    return config.get("codraft_family") or ARCHITECTURES.get((config.get("architectures") or [None])[0])


def exported_trained_on(path: str | Path) -> dict | None:
    """The prompts an exported draft records it was distilled on (None: it records none)."""
    return json.loads((Path(path) / CONFIG_FILE).read_text()).get("codraft_trained_on")


def load_draft(path: str | Path, policy: Transformer, inference_dtype: str | None = None) -> DraftModel:
    """Rebuild the draft in `path` for `policy`, attached to it and on its device (weights keep their dtype).
    `inference_dtype` (the run's `draft.inference_dtype`) replaces the saved one: how a draft's rollout matmuls run
    is the run's choice, not a property of the draft."""
    path = Path(path)
    config = json.loads((path / CONFIG_FILE).read_text())
    family = exported_family(path)
    if family not in FAMILIES:
        raise ValueError(
            f"{path / CONFIG_FILE}: codraft_family={config.get('codraft_family')!r} / "
            f"architectures={config.get('architectures')!r} name no known draft family "
            f"(known: {sorted(FAMILIES)}; architectures: {sorted(ARCHITECTURES)})"
        )
    state = load_file(str(path / WEIGHTS_FILE))
    draft = FAMILIES[family].from_export(config, state, policy.args)
    if inference_dtype is not None:
        draft.cfg = dataclasses.replace(draft.cfg, inference_dtype=inference_dtype)
    device = next(policy.parameters()).device
    return draft.to(device).attach(policy)


def read_draft(path: str, policy: Transformer, key: str, inference_dtype: str | None = None) -> DraftModel:
    """The exported draft at `path` (the value of config key `key`), as `load_draft` rebuilds it; one that cannot be
    read is a ConfigError."""
    try:
        return load_draft(path, policy, inference_dtype)
    except (OSError, ValueError, KeyError, SafetensorError) as e:  # missing files, bad config.json, torn weights
        raise ConfigError(f"{key}: {e}") from e


def draft_config(config: dict) -> DraftConfig:
    """The DraftConfig saved in an exported config (defaults where absent or from another version)."""
    saved = config.get("codraft_config") or {}
    known = {f.name for f in dataclasses.fields(DraftConfig)}
    return DraftConfig(**{k: v for k, v in saved.items() if k in known})


def load_checked(module: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """load_state_dict with errors that name the offending weights and both shapes; tensors keep their dtype."""
    expected = module.state_dict()
    missing, unexpected = sorted(expected.keys() - state.keys()), sorted(state.keys() - expected.keys())
    if missing or unexpected:
        raise ValueError(f"draft weights do not match the config: missing {missing}, unexpected {unexpected}")
    for name, t in sorted(state.items()):
        if t.shape != expected[name].shape:
            raise ValueError(
                f"draft weight {name} has shape {tuple(t.shape)} but the config gives {tuple(expected[name].shape)}"
            )
    module.load_state_dict(state, assign=True)


def exported_layer_args(base: ModelArgs, config: dict) -> ModelArgs:
    """`base` with the draft layer's shapes as an exported config.json states them (HF key names)."""
    return dataclasses.replace(
        base,
        intermediate_size=config["intermediate_size"],
        num_heads=config["num_attention_heads"],
        num_kv_heads=config["num_key_value_heads"],
        head_dim=config.get("head_dim") or base.hidden_size // config["num_attention_heads"],
        rms_norm_eps=config["rms_norm_eps"],
        rope_theta=config["rope_theta"],
        rope_scaling=config.get("rope_scaling"),
        max_position_embeddings=config.get("max_position_embeddings", base.max_position_embeddings),
    )
