"""Every test session keeps codraft's caches (GGUF conversions, warm-start drafts, distillation responses) in a
directory of its own, never in the user's ~/.cache/codraft; tests that need an empty cache set their own.
A test distils a warm-start draft only if it is marked `warm_start`. transformers' SmolLM2-135M, the reference
of the parity tests, is loaded once per session (about 30 s on a 2-core CPU)."""

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


@pytest.fixture(autouse=True)
def _no_unasked_warm_start(request, monkeypatch):
    """checkpoint.draft_init defaults to auto, so a trainer whose test does not say which draft it starts from would
    distil one with draft_train's whole budget: slow, and not what the test is about. Fail such a test instead."""
    if request.node.get_closest_marker("warm_start"):
        return
    from codraft.distill import warm_start

    def refuse(cfg, *args):
        raise AssertionError("this test would distil a warm-start draft: set checkpoint.draft_init=none (or a draft "
                             "dir), or mark the test warm_start")

    monkeypatch.setattr(warm_start, "distil", refuse)


@pytest.fixture(scope="session")
def smollm2_transformers():
    """transformers' SmolLM2-135M from the GGUF codraft loads, fp32, eval mode: the parity tests' reference."""
    pytest.importorskip("transformers")
    from codraft.models.presets import smollm2_transformers as load

    return load()
