"""Training checkpoints that a crash can never leave half-written, and that never unpickle.

A checkpoint is a directory `checkpoints/step_XXXXXX/` holding safetensors for
tensors (policy, draft, RNG states) and `torch.save` files for optimizer states
(loaded back with `weights_only=True`), plus `meta.json`. It is written under a
temporary name, fsynced, and renamed into place; `checkpoints/latest` (itself
replaced atomically) names the newest one. A directory without the rename, or a
`latest` that points nowhere, is never read.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

log = logging.getLogger(__name__)


def unique_tensors(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Drop later names of shared tensors (a tied head), which safetensors refuses to store twice."""
    seen: set[int] = set()
    out = {}
    for name, t in state.items():
        if t.data_ptr() in seen:
            continue
        seen.add(t.data_ptr())
        out[name] = t.detach().contiguous()
    return out


def _write_json(path: Path, payload: Any) -> None:
    path.write_text(json.dumps(payload, indent=2, sort_keys=True))


def _fsync_dir(path: Path) -> None:
    for f in path.iterdir():
        with open(f, "rb") as fh:
            os.fsync(fh.fileno())


def save_checkpoint(run_dir: Path, step: int, *, tensors: dict[str, dict[str, torch.Tensor]],
                    optimizers: dict[str, dict], meta: dict, keep: int) -> Path:
    """tensors: file stem -> state dict; optimizers: name -> optimizer.state_dict()."""
    root = Path(run_dir) / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{step:06d}"
    tmp = root / f".tmp-step_{step:06d}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    for stem, state in tensors.items():
        save_file(unique_tensors(state), str(tmp / f"{stem}.safetensors"))
    for name, state in optimizers.items():
        torch.save(state, tmp / f"{name}.optim.pt")
    _write_json(tmp / "meta.json", meta | {"step": step})
    _fsync_dir(tmp)
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    pointer = root / ".latest.tmp"
    pointer.write_text(final.name)
    os.replace(pointer, root / "latest")
    for old in sorted(p for p in root.glob("step_*") if p.is_dir())[:-keep]:
        shutil.rmtree(old)
    log.info("checkpoint written: %s", final)
    return final


def latest_checkpoint(run_dir: Path) -> Path:
    """The directory of the newest complete checkpoint of a run."""
    root = Path(run_dir) / "checkpoints"
    latest = root / "latest"
    if not latest.is_file():
        raise FileNotFoundError(f"{root} holds no complete checkpoint (no 'latest' pointer)")
    path = root / latest.read_text().strip()
    if not (path / "meta.json").is_file():
        raise FileNotFoundError(f"checkpoint {path} named by {latest} is missing or incomplete")
    return path


def load_checkpoint(run_dir: Path) -> dict[str, Any]:
    """The newest complete checkpoint of a run: {"meta", "tensors": {stem: state}, "optimizers": {name: state}}."""
    path = latest_checkpoint(run_dir)
    return {
        "path": path,
        "meta": json.loads((path / "meta.json").read_text()),
        "tensors": {f.name.removesuffix(".safetensors"): load_file(str(f)) for f in path.glob("*.safetensors")},
        "optimizers": {f.name.removesuffix(".optim.pt"): torch.load(f, weights_only=True)
                       for f in path.glob("*.optim.pt")},
    }
