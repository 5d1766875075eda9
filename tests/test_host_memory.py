"""host_memory.py: freed heap memory goes back to the OS; resident memory is read from /proc."""

import sys

import pytest
import torch

from codraft.host_memory import _TRIM, release_free_memory, rss_mib


@pytest.mark.skipif(_TRIM is None or not sys.platform.startswith("linux"), reason="glibc's malloc_trim only")
def test_releasing_free_memory_returns_freed_heap_pages_kept_below_a_live_block():
    # 64 MiB of small tensors (heap, not mmap), then one kept above them: glibc cannot shrink the heap's top
    held = [torch.ones(1024) for _ in range(16384)]
    top = torch.ones(1024)
    del held
    before = rss_mib()
    release_free_memory()
    after = rss_mib()
    assert before - after > 32, (before, after)
    assert top.sum() == 1024


def test_rss_of_this_process_is_positive_and_of_a_missing_process_none():
    assert rss_mib() > 0
    assert rss_mib(2**31 - 1) is None
