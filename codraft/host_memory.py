"""A training process's host memory: what it holds resident, and handing freed memory back between steps.

glibc keeps what tensors free inside its heap (after the first large free its mmap threshold rises to 32 MiB, so
a small model's activations and gradients all live there), and returns it to the OS only from the heap's top. A
step frees most of what it allocated, but where the holes fall changes from step to step: without a trim the
resident memory of the soak's tiny-llama run swung between about 540 and 750 MiB with some 330 MiB of the heap
in use, and two readings mostly showed where in that swing they fell. `release_free_memory()` after each step
(malloc_trim(0), which also gives back free pages inside the heap) makes resident memory what the process uses.
It costs about 30 ms per tiny-llama step (3% of a 1.1 s step; `time/release_memory_s`), a fixed cost that a
larger model's step dwarfs. Other C libraries: a no-op.
"""

from __future__ import annotations

import ctypes
import ctypes.util
from pathlib import Path


def _malloc_trim():
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):  # not glibc (musl, macOS)
        return None


_TRIM = _malloc_trim()


def release_free_memory() -> None:
    """Hand the heap's free pages back to the OS (glibc); nothing elsewhere."""
    if _TRIM is not None:
        _TRIM(0)


def rss_mib(pid: int | str = "self") -> float | None:
    """Resident memory of process `pid` (default this one) in MiB from /proc (Linux); None where unreadable."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None
