"""What every benchmark does the same way: timing medians, the machine, JSON + Markdown out."""

from __future__ import annotations

import json
import logging
import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from codraft.models.linear import amx, bf16_packing_available, bf16_shape_invariant

log = logging.getLogger(__name__)


def machine() -> dict:
    """What a result was measured on. The CPU's vector ISA matters as much as its cores here: where oneDNN has no
    bf16 linear (AVX2 only) the rollout's matmuls run fp32 and read twice the bytes, and the policy's do too under
    `auto` where bf16 copies are not shape-invariant (neither AMX nor codraft's kernels: models/linear.py)."""
    return {
        "cpu_count": os.cpu_count(),
        "cpu": _cpu_model(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "bf16_matmuls": bf16_packing_available(),  # oneDNN can run bf16 at all (the drafts' auto)
        "amx": amx(),  # bf16 copies on oneDNN's AMX kernel, else on codraft's where it loads (models/linear.py)
        "bf16_shape_invariant": bf16_shape_invariant(),  # the policy's auto is bf16 only then
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "platform": platform.platform(),
        "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
    }


def _cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo (Linux), else what `platform` knows."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        return platform.processor()


def read_bandwidth_gbs(nbytes: int = 1 << 30, repeats: int = 5) -> float:
    """Memory read bandwidth of this machine: best of `repeats` full reductions over `nbytes`."""
    x = torch.ones(nbytes // 4)
    x.sum()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - start)
    return nbytes / best / 1e9


def timed(fn: Callable[[], object]) -> tuple[float, object]:
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def interleaved(runs: dict[str, Callable[[], object]], repeats: int) -> tuple[dict[str, list[float]], dict]:
    """One warm-up call of each run, then `repeats` rounds calling each once in turn (so a slow spell of this
    shared machine hits every run alike) -> seconds per run per round, and each run's last output."""
    outputs = {name: fn() for name, fn in runs.items()}
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(repeats):
        for name, fn in runs.items():
            seconds, outputs[name] = timed(fn)
            times[name].append(seconds)
    return times, outputs


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def markdown_table(header: list[str], rows: list[list[object]]) -> str:
    def cell(v: object) -> str:
        if isinstance(v, float):
            return "n/a" if v != v else f"{v:.3g}" if abs(v) < 100 else f"{v:.0f}"
        return str(v)

    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def write_results(out_dir: str | Path, name: str, payload: dict, table: str) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(payload, indent=2) + "\n")
    (out / f"{name}.md").write_text(table)
    log.info("wrote %s and %s", out / f"{name}.json", out / f"{name}.md")
    return out
