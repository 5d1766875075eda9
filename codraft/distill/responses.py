"""The frozen policy's answers to distillation prompts, generated once and cached between runs.

Distillation starts by generating the policy's answers (1,280 chain prompts x ~113 tokens at T=1 took 18-23 min
here), and every family, warm start and ablation on the same policy, prompts and generation settings would
generate the same ones. They are generated in chunks of `generate_batch_size` prompts, chunk i seeded by the
run's seed and its start, so a chunk's answers depend on its own prompts only, and each chunk is cached as
soon as it is done, in `$CODRAFT_CACHE/responses/<key>.json` (default `~/.cache/codraft`): an interrupted
generation resumes at the first chunk it had not finished, and a run on more prompts of the same task stream
(a larger `draft_train.num_prompts`) generates only the chunks it adds. A key hashes what a chunk depends on:
the policy (its ModelArgs, dtype, weights fingerprint and the dtype its rollout matmuls run in), the chunk's
prompt token ids and start, draft_train's temperature, max_new_tokens and generate_batch_size, and the seed.
A file is written whole (temporary sibling, fsync, rename) and read back checked; one that is damaged or holds
another key is regenerated, with one warning saying why.
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

CACHE_FORMAT = 2  # bump when how responses are generated or stored changes (2: one file per chunk)


def generate_chunk(policy: Transformer, prompts: list[list[int]], dt: DraftTrainConfig, seed: int,
                   start: int) -> list[list[int]]:
    """One response per prompt of the chunk that starts at prompt `start` of the run, from the policy itself."""
    rollout = generate(policy, prompts, temperature=dt.temperature, max_new_tokens=dt.max_new_tokens,
                       seed=seed * 1_000_003 + start)
    return rollout.tokens


def policy_key(policy: Transformer, dt: DraftTrainConfig, seed: int) -> dict:
    """What every chunk's answers depend on besides its prompts."""
    param = next(policy.parameters())
    return {
        "format": CACHE_FORMAT,
        "policy": {"args": json.loads(json.dumps(dataclasses.asdict(policy.args))), "dtype": str(param.dtype),
                   "weights": weights_fingerprint(policy), "inference_dtype": str(policy.inference_dtype)},
        "generation": {"temperature": dt.temperature, "max_new_tokens": dt.max_new_tokens,
                       "generate_batch_size": dt.generate_batch_size, "seed": seed},
    }


def chunk_key(base: dict, prompts: list[list[int]], start: int) -> dict:
    return {**base, "start": start, "prompts_sha256": hashlib.sha256(json.dumps(prompts).encode()).hexdigest()}


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
    """The policy's answers to `prompts`: each chunk from the cache when it holds it (`draft_train.cache_responses`),
    else generated (and cached as soon as it is done)."""
    starts = range(0, len(prompts), dt.generate_batch_size)
    chunks = {start: prompts[start : start + dt.generate_batch_size] for start in starts}
    answers: dict[int, list[list[int]]] = {}
    keys: dict[int, dict] = {}
    if dt.cache_responses:
        base = policy_key(policy, dt, seed)
        for start, chunk in chunks.items():
            keys[start] = chunk_key(base, chunk, start)
            path = cache_file(keys[start])
            cached, why = read_cached(path, keys[start], len(chunk))
            if cached is not None:
                answers[start] = cached
            elif why:
                log.warning("cached responses %s not used: %s; generating them again", path, why)
        if answers:
            log.info("the policy's responses to %d of %d prompts from the cache %s",
                     sum(map(len, answers.values())), len(prompts), cache_root() / "responses")
    missing = [start for start in starts if start not in answers]
    begin, unwritable = time.perf_counter(), False
    for start in progress(missing, desc="policy responses"):
        answers[start] = generate_chunk(policy, chunks[start], dt, seed, start)
        if dt.cache_responses and not unwritable:
            try:
                write_cached(cache_file(keys[start]), keys[start], answers[start])
            except OSError as e:  # a full disk or read-only cache costs a later run the generation, not this one
                log.warning("could not cache the policy's responses in %s (%s); the next run generates them again",
                            cache_root() / "responses", e)
                unwritable = True
    if missing:
        made = [r for start in missing for r in answers[start]]
        log.info("generated %d responses (%.1f tokens each) in %.1fs", len(made), sum(map(len, made)) / len(made),
                 time.perf_counter() - begin)
    return [r for start in starts for r in answers[start]]
