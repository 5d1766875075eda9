"""codraft's own CPU kernels for rollout forwards (`cpu_kernels.cpp`, AVX-512), compiled once per machine.

oneDNN's packed fp32 kernel reads SmolLM2-135M's 538 MB of weights at 15-20 GB/s in a 1-row call with this
host's 2 threads, where a plain reduction reads ~30, and a row's last bits depend on how many rows share its call
(`linear.py`). This kernel streams weights packed in 32-channel panels and keeps a tile of up to 12 rows x 32
outputs in registers. On SmolLM2's 121 matmuls (distinct weights, so none stays in cache; stop 61, one-off
micro-benchmark, medians of 7) it took 0.50 / 0.61 / 0.62x oneDNN's time at 1 / 4 / 8 rows, 0.76-0.85x at 16-64,
0.97-1.03x at 256-2048, and a whole greedy decode step of SmolLM2 0.71 / 0.74 / 0.88x at batch 1 / 8 / 32. Each
output is one fused-multiply-add chain over the inputs whatever the call's rows, so a row's output is bitwise what
it is alone: a decode step and a verify forward compute a token's matmuls alike.

The same kernel streams bf16 weights (`bf16w_gemm`: half the bytes, widened to fp32 in registers; activations,
sums and output stay fp32, so a row's bits still do not depend on its call). On the 121 matmuls it took 0.52 /
0.62 / 0.82 / 0.96x the fp32 kernel's time at 1 / 4 / 8 / 16 rows and 1.02-1.04x at 32-256, where the fp32 fma
throughput, not the bytes, sets the pace (stop 62, same micro-benchmark).

`rms_norm`, outside autograd (models/model.py): torch's fp32 RMSNorm on CPU runs as six ops, ~2.3 ms of a
~27 ms batch-1 decode step of SmolLM2 (61 norms; the step with every norm replaced by the identity, one-off
A/B); this is one call per norm. It sums the squares in another order than torch, so its last bits differ from
training's F.rms_norm (as the matmuls' do from F.linear's); a row's output does not depend on its call's rows.

They are compiled with the C++ compiler (`$CXX`, else g++) into `$CODRAFT_CACHE/kernels/` at first use, keyed by the
source, flags and compiler, and loaded with ctypes; their OpenMP threads are torch's own (the same libgomp, whose
pool `torch.set_num_threads` sizes). Used where the CPU has AVX-512 and torch runs on OpenMP; `CODRAFT_CPU_KERNELS=0`
turns them off. Where they cannot be built or loaded, fp32 and bf16 copies stay oneDNN's (and, without AMX, the
policy's `auto` copies fp32: linear.py) and norms torch's, with one logged line.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

PANEL = 32  # output channels per panel (cpu_kernels.cpp's kPanel)
_INTERLEAVED = torch.stack([torch.arange(16), torch.arange(16) + 16], 1).flatten()  # a bf16 panel's channel order
_SOURCE = Path(__file__).with_name("cpu_kernels.cpp")
_FLAGS = ["-O3", "-mavx512f", "-mfma", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC"]
_FALLBACK = "rollout matmuls run on oneDNN, norms on torch"


@functools.cache
def cpu_kernels() -> ctypes.CDLL | None:
    """The loaded kernels, or None (with the reason logged once) where they are off or cannot run here."""
    reason = _unsupported()
    if reason:
        log.info("codraft's CPU kernels are not used (%s); %s", reason, _FALLBACK)
        return None
    try:
        lib = ctypes.CDLL(str(_build()))
    except (OSError, subprocess.SubprocessError) as e:
        log.warning("codraft's CPU kernels could not be built or loaded (%s); %s",
                    str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__, _FALLBACK)
        return None
    c_long, c_int, ptr = ctypes.c_long, ctypes.c_int, ctypes.c_void_p
    lib.fp32_gemm.argtypes = lib.bf16w_gemm.argtypes = [ptr, c_long, c_long, ptr, c_long, ptr, ptr, c_int]
    lib.rms_norm.argtypes = [ptr, c_long, c_long, ptr, ctypes.c_float, ptr, c_int]
    lib.fp32_gemm.restype = lib.bf16w_gemm.restype = lib.rms_norm.restype = None
    return lib


def _unsupported() -> str | None:
    if os.environ.get("CODRAFT_CPU_KERNELS", "1") == "0":
        return "CODRAFT_CPU_KERNELS=0"
    if not torch.backends.cpu.get_cpu_capability().startswith("AVX512"):
        return "the CPU has no AVX-512"
    if "OpenMP" not in torch.__config__.parallel_info():
        return "torch does not run on OpenMP"
    if shutil.which(_compiler()) is None:
        return f"no C++ compiler {_compiler()!r} (set CXX)"
    return None


def _compiler() -> str:
    return os.environ.get("CXX", "g++")


def _build() -> Path:
    """Compile the kernels into the cache unless a build of this source, these flags and this compiler is there."""
    from codraft.models.loading import cache_root  # loading imports linear, which imports this

    version = subprocess.run([_compiler(), "--version"], capture_output=True, text=True, check=True, timeout=60)
    key = hashlib.sha256("\0".join([_SOURCE.read_text(), *_FLAGS, version.stdout]).encode()).hexdigest()[:16]
    target = cache_root() / "kernels" / f"cpu_kernels-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:  # concurrent builds each rename a whole file
        built = Path(tmp) / target.name
        done = subprocess.run([_compiler(), *_FLAGS, str(_SOURCE), "-o", str(built)], capture_output=True, text=True,
                              timeout=300)
        if done.returncode:
            raise OSError(f"{_compiler()} failed: {done.stderr.strip()}")
        os.replace(built, target)
    log.info("built codraft's CPU kernels: %s", target)
    return target


def pack_panels(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] fp32 or bf16 weight -> [ceil(N / 32), K, 32] panels in its dtype, the channels past N zero; a bf16
    panel's 32 values at each k in the order the kernel widens them (0, 16, 1, 17, ...)."""
    if weight.dtype not in (torch.float32, torch.bfloat16):
        raise TypeError(f"codraft's kernels take fp32 or bf16 weights, not {weight.dtype}")
    n, k = weight.shape
    panels = -(-n // PANEL)
    padded = F.pad(weight.detach(), (0, 0, 0, panels * PANEL - n)).view(panels, PANEL, k).transpose(1, 2)
    return (padded if weight.dtype == torch.float32 else padded[..., _INTERLEAVED]).contiguous()


def gemm(x: torch.Tensor, panels: torch.Tensor, bias: torch.Tensor | None, out_features: int) -> torch.Tensor:
    """x [..., K] fp32 through fp32 or bf16 panels -> fp32 [..., out_features] (+ bias, fp32 [out_features])."""
    k = x.shape[-1]
    flat = x.reshape(-1, k).contiguous()
    out = torch.empty(flat.shape[0], out_features, dtype=torch.float32)
    lib = cpu_kernels()
    run = lib.fp32_gemm if panels.dtype == torch.float32 else lib.bf16w_gemm
    run(flat.data_ptr(), flat.shape[0], k, panels.data_ptr(), out_features, None if bias is None else bias.data_ptr(),
        out.data_ptr(), torch.get_num_threads())
    return out.reshape(*x.shape[:-1], out_features)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of fp32 x [..., D] with fp32 weight [D]."""
    d = x.shape[-1]
    flat = x.reshape(-1, d).contiguous()
    out = torch.empty_like(flat)
    cpu_kernels().rms_norm(flat.data_ptr(), flat.shape[0], d, weight.contiguous().data_ptr(), eps, out.data_ptr(),
                           torch.get_num_threads())
    return out.view(x.shape)
