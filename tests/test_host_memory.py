"""host_memory.py: freed memory kept for reuse (run.host_memory=keep) or handed back to the OS (release);
resident memory read from /proc."""

import subprocess
import sys

import pytest
import torch

from codraft.host_memory import _LIBC, release_free_memory, rss_mib

glibc_only = pytest.mark.skipif(_LIBC is None or not sys.platform.startswith("linux"), reason="glibc's malloc only")

# Page faults of filling a 255 MiB tensor allocated after a 256 MiB one was freed (smaller: a memalign'd block
# needs its alignment's slack, so an exact-size hole may not fit it).
REFAULTS = """
import resource, sys, torch
from codraft.host_memory import keep_freed_memory
if sys.argv[1] == "keep":
    assert keep_freed_memory()
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
x = torch.ones(64 << 20); del x
before = faults(); x = torch.ones((64 << 20) - (1 << 18))
print(faults() - before)
"""


def refaults(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", REFAULTS, mode], capture_output=True, text=True, timeout=120,
                         check=True)
    return int(out.stdout.split()[-1])


@glibc_only
def test_kept_memory_is_reused_without_faulting_its_pages_in_again():
    pages = (255 << 20) // 4096
    assert refaults("default") > pages // 2  # glibc unmapped the first block: every page faults in anew
    assert refaults("keep") < pages // 100


@glibc_only
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


def test_near_full_memory_warns_once_naming_what_would_lower_it(monkeypatch, caplog):
    from codraft import host_memory

    monkeypatch.setattr(host_memory, "_warned", False)
    assert not host_memory.warn_if_near_full(800.0, "keep", total=1000.0)  # below NEAR_FULL: quiet
    with caplog.at_level("WARNING", logger="codraft.host_memory"):
        assert host_memory.warn_if_near_full(900.0, "keep", total=1000.0)
        assert not host_memory.warn_if_near_full(990.0, "keep", total=1000.0)  # once per process
    assert len(caplog.records) == 1
    assert "run.host_memory=release" in caplog.text and "draft.num_anchors" in caplog.text
    assert host_memory.mem_total_mib() > 0
