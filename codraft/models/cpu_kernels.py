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
throughput, not the bytes, sets the pace (stop 62, same micro-benchmark). Where the CPU has AVX-512 BF16,
`bf16_gemm` rounds the activations to bf16 and sums bf16 dot products in fp32 (vdpbf16ps: two multiply-adds a lane
and no widening): 0.91 / 0.85 / 0.80 / 0.65 / 0.61x `bf16w_gemm`'s time at 1 / 4 / 8 / 16 / 24 rows (stop 63,
same micro-benchmark, the AMD host). A row's bits still do not depend on its call.

`cache_attention`: a decode, verify or draft step's attention over a KV cache, one query at a time (one fma chain
over the keys it sees, whatever its call's other queries and rows or the columns it does not see): the grouped
matmuls it replaces (cache_attention.py) gave a query other last bits in a decode step than in a verify forward,
which bf16 activations round into whole bf16 steps.

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
MAX_HEAD_DIM = 256  # the widest head `cache_attention` takes (its 16 accumulators of 16 lanes)
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
    c_long, c_int, ptr, c_float = ctypes.c_long, ctypes.c_int, ctypes.c_void_p, ctypes.c_float
    for gemm_kernel in (lib.fp32_gemm, lib.bf16w_gemm, lib.bf16_gemm):
        gemm_kernel.argtypes, gemm_kernel.restype = [ptr, c_long, c_long, ptr, c_long, ptr, ptr, c_int], None
    lib.rms_norm.argtypes, lib.rms_norm.restype = [ptr, c_long, c_long, ptr, c_float, ptr, c_int], None
    lib.cache_attention.argtypes = [ptr, *[c_long] * 3, ptr, ptr, *[c_long] * 3, ptr, *[c_long] * 2, ptr,
                                    *[c_long] * 9, c_float, c_int]
    lib.cache_attention.restype = None
    lib.has_avx512_bf16.argtypes, lib.has_avx512_bf16.restype = [], c_int
    return lib


@functools.cache
def bf16_dot_products() -> bool:
    """The kernels load and the CPU has AVX-512 BF16: bf16 panels run `bf16_gemm` (activations rounded to bf16)."""
    lib = cpu_kernels()
    return lib is not None and bool(lib.has_avx512_bf16())


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


def pack_panels(weight: torch.Tensor, pairs: bool | None = None) -> torch.Tensor:
    """[N, K] fp32 or bf16 weight -> panels of 32 output channels in its dtype, the channels past N zero: fp32
    [ceil(N / 32), K, 32]; bf16 as pairs [ceil(N / 32), K / 2, 32, 2] for `bf16_gemm` where `pairs` (default:
    `bf16_dot_products()`) and K is even, else [ceil(N / 32), K, 32] with each k's 32 values in the order
    `bf16w_gemm` widens them (0, 16, 1, 17, ...)."""
    if weight.dtype not in (torch.float32, torch.bfloat16):
        raise TypeError(f"codraft's kernels take fp32 or bf16 weights, not {weight.dtype}")
    n, k = weight.shape
    panels = -(-n // PANEL)
    padded = F.pad(weight.detach(), (0, 0, 0, panels * PANEL - n)).view(panels, PANEL, k)
    if weight.dtype == torch.float32:
        return padded.transpose(1, 2).contiguous()
    if (bf16_dot_products() if pairs is None else pairs) and k % 2 == 0:
        return padded.view(panels, PANEL, k // 2, 2).transpose(1, 2).contiguous()
    return padded.transpose(1, 2)[..., _INTERLEAVED].contiguous()


def panel_kind(panels: torch.Tensor) -> str:
    """Which kernel runs `pack_panels`' panels: fp32, bf16 (pairs: bf16 activations) or bf16w (widened weights)."""
    if panels.dtype == torch.float32:
        return "fp32"
    return "bf16" if panels.dim() == 4 else "bf16w"


def gemm(x: torch.Tensor, panels: torch.Tensor, bias: torch.Tensor | None, out_features: int) -> torch.Tensor:
    """x [..., K] fp32 through `pack_panels`' panels -> fp32 [..., out_features] (+ bias, fp32 [out_features]);
    through bf16 pairs x is rounded to bf16 first."""
    k = x.shape[-1]
    flat = x.reshape(-1, k).contiguous()
    out = torch.empty(flat.shape[0], out_features, dtype=torch.float32)
    run = getattr(cpu_kernels(), f"{panel_kind(panels)}_gemm")
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


def cache_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    """softmax(q k^T / sqrt(D)) v, fp32: q [B, H, S, D], keys/values [B, Hkv, L, D] (the same strides, e.g. views of
    a cache), visible [B, S or 1, L] uint8 -> [B, H, S, D] (a view of [B, S, H, D] memory); D contiguous
    everywhere. A query's output depends only on it and the keys it sees (cpu_kernels.cpp)."""
    B, H, S, D = q.shape
    Hkv, L = keys.shape[1], keys.shape[2]
    assert keys.stride() == values.stride() and q.stride(-1) == keys.stride(-1) == visible.stride(-1) == 1
    assert D <= MAX_HEAD_DIM, f"the kernel takes head dims up to {MAX_HEAD_DIM}, not {D}"
    out = torch.empty(B, S, H, D).transpose(1, 2)
    cpu_kernels().cache_attention(
        q.data_ptr(), *q.stride()[:3], keys.data_ptr(), values.data_ptr(), *keys.stride()[:3], visible.data_ptr(),
        visible.stride(0), visible.stride(1) if visible.shape[1] > 1 else 0, out.data_ptr(), *out.stride()[:3],
        B, H, S, Hkv, L, D, D**-0.5, torch.get_num_threads())
    return out
