"""`checkpoint.draft_init=auto`: start RL from a draft distilled for this policy and config, cached between runs.

The cache entry of a run is `$CODRAFT_CACHE/drafts/<family>-<model>-<key>/` (default `~/.cache/codraft`),
where key is a hash of `cache_key`: the policy (model.path, model.dtype, its ModelArgs and a fingerprint of
its weights), draft.*, task.* (and a JSONL dataset's bytes), draft_train.* and run.seed, less the settings the
distilled weights do not depend on (`UNUSED`: task.reward, the draft's rollout dtype, draft-train's eval, export
and response-cache settings), so changing one of those does not distil again. An entry is an exported draft
(drafts/export.py) plus `cache.json`, written last: the key it was made for and the sha256 of each file.

A hit is an entry whose cache.json holds this run's key, whose files still have their recorded hashes, and
whose draft loads for this policy and is of draft.family. Anything short of that (no entry, no or unreadable
cache.json, another key, truncated or altered weights, a draft of other shapes or family) is never loaded:
one logged line says why, then a draft is distilled with draft-train's code (distill/distill.py, budget
draft_train.*, its own progress bar), exported into a temporary directory and renamed into place. A file
lock per entry makes concurrent runs (or the ranks of one run) wait for one distillation instead of
repeating it, and distillation draws from its own RNG, so a hit and a miss leave the run in the same state.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import logging
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import SafetensorError

from codraft.config import Config
from codraft.distill.distill import distillation_prompts, live_accuracy, split_prompts, start_distillation
from codraft.distill.fingerprint import file_sha256, key_digest, weights_fingerprint
from codraft.drafts import build_draft
from codraft.drafts.base import DraftModel
from codraft.drafts.export import CONFIG_FILE, WEIGHTS_FILE, check_family, export_draft, load_draft, read_draft
from codraft.host_memory import step_end
from codraft.models import Tokenizer, Transformer
from codraft.models.loading import cache_root
from codraft.observability import progress

log = logging.getLogger(__name__)

CACHE_FORMAT = 1  # bump when what an entry holds, or how a draft is distilled, changes
MARKER = "cache.json"
NO_ENTRY = "no cached draft"  # the one reason for distilling that is not worth a warning


# settings a warm start's distilled weights do not depend on: it runs no eval and exports once, the draft's
# rollout dtype applies when it is loaded, and the reward is never read
UNUSED = {
    "task": ("reward",),
    "draft": ("inference_dtype",),
    "draft_train": ("held_out_prompts", "eval_k", "eval_max_new_tokens", "save_every", "cache_responses"),
}


def used_settings(section: str, settings) -> dict:
    return {k: v for k, v in dataclasses.asdict(settings).items() if k not in UNUSED[section]}


def cache_key(cfg: Config, policy: Transformer) -> dict:
    """Everything the distilled draft depends on, as plain JSON."""
    path = Path(cfg.model.path).expanduser()
    model_path = str(path.resolve()) if path.exists() else cfg.model.path  # a file or dir by place, a preset by name
    task = used_settings("task", cfg.task)
    if cfg.task.kind == "jsonl":
        task["data_sha256"] = file_sha256(Path(cfg.task.path))
    key = {
        "format": CACHE_FORMAT,
        "policy": {"path": model_path, "dtype": cfg.model.dtype, "args": dataclasses.asdict(policy.args),
                   "weights": weights_fingerprint(policy),
                   "inference_dtype": str(policy.inference_dtype)},  # its answers and taps are computed in it
        "draft": used_settings("draft", cfg.draft),
        "task": task,
        "draft_train": used_settings("draft_train", cfg.draft_train),
        "seed": cfg.run.seed,
    }
    return json.loads(json.dumps(key))  # as cache.json holds it (tuples become lists)


def entry_dir(cfg: Config, key: dict) -> Path:
    digest = key_digest(key)
    model = re.sub(r"[^A-Za-z0-9_.-]+", "_", Path(cfg.model.path).name) or "model"
    return cache_root() / "drafts" / f"{cfg.draft.family}-{model}-{digest}"


@contextlib.contextmanager
def entry_lock(entry: Path) -> Iterator[None]:
    """Exclusive use of `entry` among processes on this host (released when the process dies)."""
    entry.parent.mkdir(parents=True, exist_ok=True)
    with open(entry.parent / f"{entry.name}.lock", "w") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("waiting for another process to finish the draft in %s", entry)
            fcntl.flock(f, fcntl.LOCK_EX)
        yield  # closing the file releases the lock


def read_entry(entry: Path, key: dict, policy: Transformer, family: str,
               inference_dtype: str) -> tuple[DraftModel | None, str]:
    """(the cached draft, "") on a hit, else (None, why not). The key leaves the draft's rollout dtype out: a hit
    runs in the run's `inference_dtype`."""
    if not entry.is_dir():
        return None, NO_ENTRY
    try:
        marker = json.loads((entry / MARKER).read_text())
    except FileNotFoundError:
        return None, f"incomplete entry (no {MARKER})"
    except (OSError, ValueError) as e:
        return None, f"{MARKER} is unreadable ({e})"
    if not isinstance(marker, dict) or marker.get("key") != key:
        saved = marker.get("key") if isinstance(marker, dict) else None
        differ = sorted(k for k in key if not isinstance(saved, dict) or saved.get(k) != key[k])
        return None, f"made for another {', '.join(differ) or 'key'}"
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        recorded = (marker.get("files") or {}).get(name)
        if not (entry / name).is_file() or file_sha256(entry / name) != recorded:
            return None, f"{name} is missing, truncated or altered (its sha256 is not the one recorded)"
    try:
        draft = load_draft(entry, policy, inference_dtype)
    except (OSError, ValueError, KeyError, SafetensorError) as e:
        return None, f"it does not load for this policy: {e}"
    if draft.family != family:
        return None, f"it holds a {draft.family} draft, not draft.family={family}"
    return draft, ""


def distil(cfg: Config, policy: Transformer, tokenizer: Tokenizer) -> DraftModel:
    """A `draft.family` draft distilled on the policy's answers to the first `draft_train.num_prompts` prompts."""
    dt = cfg.draft_train
    prompts, _ = split_prompts(cfg, tokenizer, held_out=0)
    device = next(policy.parameters()).device
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):  # the run's RNG is left as it was
        distiller = start_distillation(cfg, policy, tokenizer, prompts)
        bar = progress(range(dt.steps), desc=f"warm-start {cfg.draft.family} draft")
        for _ in bar:
            metrics = distiller.step()
            step_end(cfg.run.host_memory)
            bar.set_postfix({"loss": f"{metrics['loss/draft']:.3f}", "acc": f"{live_accuracy(metrics):.3f}"})
    return distiller.draft


def write_entry(entry: Path, key: dict, draft: DraftModel, trained_on: dict | None = None) -> None:
    """Export `draft` with its marker into a temporary sibling, sync it, then rename it over `entry`."""
    staging = Path(tempfile.mkdtemp(prefix=f".{entry.name}.", dir=entry.parent))
    try:
        out = export_draft(draft, staging / "draft", trained_on)
        files = {name: file_sha256(out / name) for name in (CONFIG_FILE, WEIGHTS_FILE)}
        (out / MARKER).write_text(json.dumps({"key": key, "files": files}, indent=2, sort_keys=True) + "\n")
        for f in out.iterdir():
            with f.open("rb") as fh:
                os.fsync(fh.fileno())
        shutil.rmtree(entry, ignore_errors=True)  # an entry that was not a hit; we hold its lock
        os.replace(out, entry)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def warm_start_draft(cfg: Config, policy: Transformer, tokenizer: Tokenizer) -> DraftModel:
    """The cached draft for this policy and config; distilled and cached first if there is no usable one."""
    key = cache_key(cfg, policy)
    entry = entry_dir(cfg, key)
    with entry_lock(entry):
        draft, why = read_entry(entry, key, policy, cfg.draft.family, cfg.draft.inference_dtype)
        if draft is not None:
            log.info("warm start: the cached %s draft %s", cfg.draft.family, entry)
            return draft
        log.log(logging.INFO if why == NO_ENTRY else logging.WARNING,
                "warm start: %s in %s: distilling a %s draft (draft_train.num_prompts=%d, draft_train.steps=%d)",
                why, entry, cfg.draft.family, cfg.draft_train.num_prompts, cfg.draft_train.steps)
        write_entry(entry, key, distil(cfg, policy, tokenizer), distillation_prompts(cfg))
        draft, why = read_entry(entry, key, policy, cfg.draft.family, cfg.draft.inference_dtype)
        assert draft is not None, f"the draft just written to {entry} does not read back: {why}"
        log.info("warm start: cached the distilled %s draft in %s", cfg.draft.family, entry)
        return draft


def initial_draft(cfg: Config, policy: Transformer, tokenizer: Tokenizer,
                  corpus: list[list[int]] | None = None) -> DraftModel | None:
    """The draft a run starts from: none (draft.family=none), the warm start (checkpoint.draft_init=auto), an
    exported draft dir, or a fresh draft whose vocabulary counts come from `corpus` (draft_init=none)."""
    if cfg.draft.family == "none":
        return None
    if cfg.checkpoint.draft_init == "auto":
        return warm_start_draft(cfg, policy, tokenizer)
    if cfg.checkpoint.draft_init is not None:
        return check_family(read_draft(cfg.checkpoint.draft_init, policy, "checkpoint.draft_init",
                                       cfg.draft.inference_dtype),
                            "checkpoint.draft_init", "draft.family", cfg.draft.family)
    return build_draft(cfg.draft, policy, tokenizer, corpus or ())
