"""A training process's host memory: keeping freed memory for reuse, or handing it back between steps; what
the process holds resident.

`run.host_memory=keep` (the default, `keep_freed_memory()`): glibc serves every block from its heap and never
gives the heap back. By default it maps each block above its mmap threshold (32 MiB at most) on its own and
unmaps it on free, so the next such block faults its pages in again, zeroed by the kernel. A training step of
SmolLM2 frees and re-allocates dozens of [tokens, vocab] tensors (~200 MiB each at 1k tokens): one update of
4 x 272 tokens spent about a third of its CPU time in the kernel faulting pages in, and keeping freed memory
cut training time to 0.71x in `codraft train` (README, "Host memory"). Kept, the process's resident memory is
its high-water mark.

`run.host_memory=release` (`release_free_memory()` after each train or draft-train step): malloc_trim(0) gives
free pages back, also from inside the heap, so resident memory is what the process uses at the step's end, at
the price of faulting them in again next step. Other C libraries: both are no-ops.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import time
from pathlib import Path

log = logging.getLogger(__name__)

# mallopt parameters (malloc.h)
M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4


def _glibc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        return libc if libc is not None and libc.malloc_trim and libc.mallopt else None
    except (OSError, AttributeError):  # not glibc (musl, macOS)
        return None


_LIBC = _glibc()


def keep_freed_memory() -> bool:
    """From now on serve large blocks from the heap (no mmap) and never trim it (glibc); False elsewhere."""
    if _LIBC is None:
        log.debug("run.host_memory=keep: not glibc, the C library's default stays")
        return False
    # mallopt returns 1 on success; -1 as the trim threshold turns trimming off (mallopt(3))
    return bool(_LIBC.mallopt(M_MMAP_MAX, 0)) and bool(_LIBC.mallopt(M_TRIM_THRESHOLD, -1))


def release_free_memory() -> None:
    """Hand the heap's free pages back to the OS (glibc); nothing elsewhere."""
    if _LIBC is not None:
        _LIBC.malloc_trim(0)


def step_end(setting: str) -> dict[str, float]:
    """After a train or distillation step: under `run.host_memory=release` hand the step's freed memory back
    (timed apart from the step); this process's resident memory either way."""
    out = {}
    if setting == "release":
        t = time.perf_counter()
        release_free_memory()
        out["time/release_memory_s"] = time.perf_counter() - t
    out["memory/rss_mib"] = rss_mib() or float("nan")
    warn_if_near_full(out["memory/rss_mib"], setting)
    return out


NEAR_FULL = 0.85  # share of the machine's memory past which a step warns: the next steps may swap or be killed
_warned = False


def warn_if_near_full(rss: float, setting: str, total: float | None = None) -> bool:
    """Warn once per process when resident memory `rss` (MiB) passes NEAR_FULL of the machine's (`total`, MiB;
    read from /proc/meminfo by default). Under `keep` the heap only grows: DFlash's and DSpark's distillation
    steps grew it step after step until the host swapped, while each step drew its own block count (README, "Host
    memory"; padded since, drafts/anchors.py, growth ~11 MB a step remains)."""
    global _warned
    if _warned:  # once warned, no step reads /proc/meminfo again
        return False
    total = total or mem_total_mib()
    if total is None or not rss > NEAR_FULL * total:
        return False
    _warned = True
    log.warning("resident memory %.1f GiB is %.0f%% of this machine's %.1f GiB: the next steps may swap or be "
                "killed. %sSmaller steps need less (draft_train.batch_size, draft.num_anchors, rl.prompts_per_step).",
                rss / 1024, 100 * rss / total, total / 1024,
                "run.host_memory=release hands freed memory back after each step (each step then faults its "
                "pages in again). " if setting == "keep" else "")
    return True


def mem_total_mib() -> float | None:
    """This machine's memory in MiB from /proc/meminfo (Linux); None where unreadable."""
    return _proc_mib("/proc/meminfo", "MemTotal:")


def rss_mib(pid: int | str = "self") -> float | None:
    """Resident memory of process `pid` (default this one) in MiB from /proc (Linux); None where unreadable."""
    return _proc_mib(f"/proc/{pid}/status", "VmRSS:")


def _proc_mib(path: str, field: str) -> float | None:
    """A `field:  N kB` line of a /proc file in MiB; None where the file or the field is missing."""
    try:
        for line in Path(path).read_text().splitlines():
            if line.startswith(field):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None
