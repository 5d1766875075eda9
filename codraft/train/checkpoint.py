"""Training checkpoints that a crash can never leave half-written, and that never unpickle.

A checkpoint is a directory `checkpoints/step_XXXXXX/` holding safetensors for
tensors (policy, draft, RNG states) and `torch.save` files for optimizer states
(loaded back with `weights_only=True`), plus `meta.json`, which lists every file
with its size. It is written under a temporary name, fsynced, and renamed into
place; `checkpoints/latest` (itself replaced atomically) names the newest one.

Reading takes the newest checkpoint that is complete (its files have the sizes
meta.json lists) and loads; anything newer that is not (a truncated file, a
missing `latest` pointer, an unfinished write) is skipped with one warning.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

log = logging.getLogger(__name__)
T = TypeVar("T")

META = "meta.json"
# what reading a damaged checkpoint file raises (torch.load: truncated zip, bad pickle opcodes)
UNREADABLE = (OSError, ValueError, RuntimeError, EOFError, KeyError, pickle.UnpicklingError, SafetensorError)


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
    for stale in root.glob(".tmp-step_*"):  # unfinished writes of an earlier, killed process
        shutil.rmtree(stale)
    final = root / f"step_{step:06d}"
    tmp = root / f".tmp-step_{step:06d}"
    tmp.mkdir()
    for stem, state in tensors.items():
        save_file(unique_tensors(state), str(tmp / f"{stem}.safetensors"))
    for name, state in optimizers.items():
        torch.save(state, tmp / f"{name}.optim.pt")
    files = {f.name: f.stat().st_size for f in sorted(tmp.iterdir())}
    _write_json(tmp / META, meta | {"step": step, "files": files})
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


def _incomplete(path: Path) -> str | None:
    """Why the checkpoint directory `path` is not complete, or None when it is."""
    try:
        meta = json.loads((path / META).read_text())
    except (OSError, ValueError) as e:
        return f"{META}: {e}"
    for name, size in meta.get("files", {}).items():  # checkpoints written before the listing: meta.json only
        have = (path / name).stat().st_size if (path / name).is_file() else None
        if have != size:
            return f"{name} is missing" if have is None else f"{name} has {have} of its {size} bytes"
    return None


def _newest(run_dir: Path, read: Callable[[Path], T]) -> T:
    """`read` of the newest checkpoint directory of a run that is complete and that `read` can read; one warning
    names whatever newer was skipped; FileNotFoundError when none is left."""
    root = Path(run_dir) / "checkpoints"
    latest = (root / "latest").read_text().strip() if (root / "latest").is_file() else None
    skipped = [] if latest else ["no 'latest' pointer"]
    skipped += [f"{p.name} (an unfinished write)" for p in sorted(root.glob(".tmp-step_*"))]
    for path in sorted((p for p in root.glob("step_*") if p.is_dir()), reverse=True):
        reason = _incomplete(path)
        if reason is None:
            try:
                value = read(path)
            except UNREADABLE as e:  # damaged in place: the size is right, the content is not
                reason = " ".join(f"{type(e).__name__}: {e}".split())[:200]
            else:
                if skipped or latest != path.name:
                    log.warning("using %s, the newest complete checkpoint; skipped %s", path,
                                ", ".join(skipped) or f"the 'latest' pointer to {latest}")
                return value
        skipped.append(f"{path.name} ({reason})")
    raise FileNotFoundError(f"{root} holds no complete checkpoint" + (f"; skipped {', '.join(skipped)}"
                                                                        if skipped else ""))


def latest_checkpoint(run_dir: Path) -> Path:
    """The directory of the newest complete checkpoint of a run."""
    return _newest(run_dir, lambda path: path)


def load_checkpoint(run_dir: Path) -> dict[str, Any]:
    """The newest checkpoint of a run that is complete and loads:
    {"path", "meta", "tensors": {stem: state}, "optimizers": {name: state}}."""
    return _newest(run_dir, _load)


def load_weights(run_dir: Path) -> tuple[Path, dict[str, dict[str, torch.Tensor]]]:
    """The tensors of a run's newest complete checkpoint that loads ({stem: state}, no optimizer states), and
    its directory."""
    return _newest(run_dir, lambda path: (path, _tensors(path)))


def load_policy_state(policy: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Checkpointed policy weights into `policy` (a tied head is stored once, as the embedding); ValueError
    naming the keys if they do not fit."""
    missing, unexpected = policy.load_state_dict(state, strict=False)
    tied = {"lm_head.weight"} if policy.args.tie_word_embeddings else set()
    if set(missing) - tied or unexpected:
        raise ValueError(f"policy weights do not fit (missing {missing}, unexpected {unexpected})")


def _tensors(path: Path) -> dict[str, dict[str, torch.Tensor]]:
    return {f.name.removesuffix(".safetensors"): load_file(str(f)) for f in path.glob("*.safetensors")}


def _load(path: Path) -> dict[str, Any]:
    return {
        "path": path,
        "meta": json.loads((path / META).read_text()),
        "tensors": _tensors(path),
        "optimizers": {f.name.removesuffix(".optim.pt"): torch.load(f, weights_only=True)
                       for f in path.glob("*.optim.pt")},
    }
