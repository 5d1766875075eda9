"""What the caches of distill/ key on: a cheap fingerprint of a model's weights, a file's sha256, and the short
digest of a key that names a cache entry."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch

FINGERPRINT_SAMPLES = 4096  # values per weight tensor that the fingerprint reads


def weights_fingerprint(model: torch.nn.Module) -> str:
    """sha256 over every tensor's name, shape, dtype and an evenly strided sample of its values: cheap at any
    model size, and any fine-tune (which moves every value of the tensors it trains) changes it."""
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        flat = t.detach().reshape(-1)
        sample = flat[:: max(1, flat.numel() // FINGERPRINT_SAMPLES)][:FINGERPRINT_SAMPLES]
        h.update(f"{name}|{tuple(t.shape)}|{t.dtype}|".encode())
        h.update(sample.float().cpu().numpy().tobytes())
    return h.hexdigest()


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def key_digest(key: dict) -> str:
    """16 hex digits naming the cache entry of `key` (plain JSON), the same for equal keys in any order."""
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
