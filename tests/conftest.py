"""Every test session keeps codraft's caches (GGUF conversions, warm-start drafts, distillation responses) in a
directory of its own, never in the user's ~/.cache/codraft; tests that need an empty cache set their own."""

import os

import pytest


@pytest.fixture(autouse=True, scope="session")
def _session_cache(tmp_path_factory):
    before = os.environ.get("CODRAFT_CACHE")
    os.environ["CODRAFT_CACHE"] = str(tmp_path_factory.mktemp("codraft-cache"))
    yield
    if before is None:
        os.environ.pop("CODRAFT_CACHE", None)
    else:
        os.environ["CODRAFT_CACHE"] = before
