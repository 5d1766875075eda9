"""The frozen policy's answers to distillation prompts, generated once and cached between runs.

Distillation starts by generating the policy's answers (320 chain prompts x ~110 tokens at T=1 took 13 min
here), and every family, warm start and ablation on the same policy, prompts and generation settings would
generate the same ones. They are kept in `$CODRAFT_CACHE/responses/<key>.json` (default `~/.cache/codraft`),
where key hashes what they depend on: the policy (its ModelArgs, dtype, weights fingerprint and the dtype its
rollout matmuls run in), the prompts' token ids and draft_train's temperature, max_new_tokens and
generate_batch_size, and the seed. A file is written whole (temporary sibling, fsync, rename) and read back
checked; one that is damaged or holds another key is regenerated, with one warning saying why.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import tempfile
import time
from pathlib import Path

from codraft.config import DraftTrainConfig
from codraft.distill.fingerprint import key_digest, weights_fingerprint
from codraft.models import Transformer
from codraft.models.loading import cache_root
from codraft.observability import progress
from codraft.rollout import generate

log = logging.getLogger(__name__)

CACHE_FORMAT = 1  # bump when how responses are generated changes


def generate_responses(policy: Transformer, prompts: list[list[int]], dt: DraftTrainConfig,
                       seed: int) -> list[list[int]]:
    """One response per prompt from the policy itself, in batches of `generate_batch_size`."""
    start, out = time.perf_counter(), []
    for i in progress(range(0, len(prompts), dt.generate_batch_size), desc="policy responses"):
        rollout = generate(policy, prompts[i : i + dt.generate_batch_size], temperature=dt.temperature,
                           max_new_tokens=dt.max_new_tokens, seed=seed * 1_000_003 + i)
        out += rollout.tokens
    tokens = sum(map(len, out))
    log.info("generated %d responses (%.1f tokens each) in %.1fs", len(out), tokens / len(out),
             time.perf_counter() - start)
    return out


def responses_key(policy: Transformer, prompts: list[list[int]], dt: DraftTrainConfig, seed: int) -> dict:
    param = next(policy.parameters())
    return {
        "format": CACHE_FORMAT,
        "policy": {"args": json.loads(json.dumps(dataclasses.asdict(policy.args))), "dtype": str(param.dtype),
                   "weights": weights_fingerprint(policy), "inference_dtype": str(policy.inference_dtype)},
        "prompts_sha256": hashlib.sha256(json.dumps(prompts).encode()).hexdigest(),
        "generation": {"temperature": dt.temperature, "max_new_tokens": dt.max_new_tokens,
                       "generate_batch_size": dt.generate_batch_size, "seed": seed},
    }


def cache_file(key: dict) -> Path:
    return cache_root() / "responses" / f"{key_digest(key)}.json"


def read_cached(path: Path, key: dict, count: int) -> tuple[list[list[int]] | None, str]:
    """(the responses, "") if `path` holds `count` of them for `key`, else (None, why not)."""
    if not path.is_file():
        return None, ""
    try:
        saved = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        return None, f"it is unreadable ({e})"
    if not isinstance(saved, dict) or saved.get("key") != key:
        return None, "it was made for another key"
    responses = saved.get("responses")
    if (not isinstance(responses, list) or len(responses) != count
            or not all(isinstance(r, list) and all(isinstance(t, int) for t in r) for r in responses)):
        return None, f"it does not hold {count} lists of token ids"
    return responses, ""


def write_cached(path: Path, key: dict, responses: list[list[int]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump({"key": key, "responses": responses}, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def policy_responses(policy: Transformer, prompts: list[list[int]], dt: DraftTrainConfig,
                     seed: int) -> list[list[int]]:
    """The policy's answers to `prompts`: from the cache when it holds them (`draft_train.cache_responses`),
    else generated (and cached)."""
    if not dt.cache_responses:
        return generate_responses(policy, prompts, dt, seed)
    key = responses_key(policy, prompts, dt, seed)
    path = cache_file(key)
    responses, why = read_cached(path, key, len(prompts))
    if responses is not None:
        log.info("the policy's %d responses from the cache %s", len(responses), path)
        return responses
    if why:
        log.warning("cached responses %s not used: %s; generating them again", path, why)
    responses = generate_responses(policy, prompts, dt, seed)
    try:
        write_cached(path, key, responses)
    except OSError as e:  # a full disk or read-only cache costs the next run a generation, not this one its answers
        log.warning("could not cache the policy's responses in %s (%s); the next run generates them again", path, e)
    return responses
