"""nn.Linear that, outside autograd, can run on a oneDNN-packed copy of its weight.

Rollout forwards on CPU feed 1 to a few dozen rows. MKL's fp32 GEMM at 2-8 rows
costs 1.5-2x its 1-row GEMV on this machine, so a verify forward of k+1 tokens
cost far more than a decode step. oneDNN's kernel over a weight reordered once
into its blocked layout reads the weight once at any small row count (measured
on SmolLM2-135M's 211 matmuls: 1 row 45 -> 25 ms, 4 rows 61 -> 28 ms, 32 rows
108 -> 55 ms), and its rows do not depend on how many rows share the call.

`pack_linears(module)` makes the copies (one per Linear, the weight's version and
address recorded); a Linear uses its copy only while autograd is off and the
weight is unchanged, so training forwards and gradients never see it, and an
optimizer step (in place, so it bumps the version) or a `.to()` makes the copy
stale until the next pack.
Writes that bypass the version counter (`dist.broadcast` into `.data`) must
call `unpack_linears` or `pack_linears(..., force=True)`.

oneDNN picks its kernel by row count, and on this machine 1 and 2 rows run a
path 1.2-1.5x slower than 3-6 rows over the same weight (every SmolLM2 shape,
lm_head included). `row_padding()` measures that once per process and packed
calls with too few rows run zero-padded to the fastest count; the real rows'
results are the same bits either way (tested).

oneDNN also builds (JIT-compiles) and keeps a kernel per row count met, about 0.5 MiB each, and the rollout's
row counts vary from step to step (rows still decoding, times k+1 in a verify, a prefill's prompt tokens): the
soak's resident memory grew for ~60 steps as new counts appeared (+11% from step 10 to 60). So a packed call
runs zero-padded to one of eight row counts per doubling above 8 rows (`run_rows`; under 1/8 of its rows are
padding, which costs SmolLM2-sized matmuls a few percent), and the first pack of each weight shape builds the
kernels of all 48 counts up to 256 (`_warm`: about 2.7 s once for SmolLM2-135M, most of it lm_head). Memory then
stops growing at the start, but for the few counts of longer prefills.
"""

from __future__ import annotations

import logging
import time

import torch
import torch.nn.functional as F
from torch import nn

log = logging.getLogger(__name__)

_PACKABLE_DTYPES = (torch.float32, torch.bfloat16)
_MAX_PADDED_ROWS = 8
_MIN_PADDING_GAIN = 0.9  # pad only where the padded call measured at most 90% of the unpadded one
_WARM_ROWS = 256  # `_warm` builds the kernels of the row counts up to this
_row_padding: dict[int, int] | None = None
_warmed: set[tuple] = set()  # the weight shapes whose kernels `_warm` has built in this process


def row_padding() -> dict[int, int]:
    """{rows: rows to run} for packed calls that are faster zero-padded; measured once per process over
    48 MB of packed weights (more than the last-level cache, as a model's are), medians of interleaved runs."""
    global _row_padding
    if _row_padding is None:
        _row_padding = _measure_row_padding() if packing_available() else {}
        log.info("packed linear row padding (measured): %s", _row_padding or "none")
    return _row_padding


@torch.no_grad()
def _measure_row_padding(repeats: int = 3) -> dict[int, int]:
    weights = [torch.ops.mkldnn._reorder_linear_weight(torch.full((1024, 1024), 0.5), None) for _ in range(12)]
    inputs = {m: torch.randn(m, 1024) for m in range(1, _MAX_PADDED_ROWS + 1)}
    times: dict[int, list[float]] = {m: [] for m in inputs}
    for _ in range(repeats):
        for m, x in inputs.items():
            start = time.perf_counter()
            for w in weights:
                torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")
            times[m].append(time.perf_counter() - start)
    cost = {m: sorted(ts)[len(ts) // 2] for m, ts in times.items()}
    padding = {}
    for m in cost:
        best = min(range(m, _MAX_PADDED_ROWS + 1), key=cost.__getitem__)
        if cost[best] <= _MIN_PADDING_GAIN * cost[m]:
            padding[m] = best
    return padding


def packing_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


class Linear(nn.Linear):
    """nn.Linear (same parameters and state dict) with an optional packed weight for inference."""

    packed: tuple[tuple[int, int], torch.Tensor] | None = None  # (weight's version and address, packed weight)

    def _key(self) -> tuple[int, int]:
        """Changes when the weight does: in-place updates bump the version, `.to()`/`.data =` move the storage."""
        return self.weight._version, self.weight.data_ptr()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        packed = self.packed
        if packed is not None and not torch.is_grad_enabled() and packed[0] == self._key():
            rows = x.numel() // self.in_features
            padding = run_rows(rows) - rows
            if not padding:
                return torch.ops.mkldnn._linear_pointwise(x, packed[1], self.bias, "none", [], "")
            x2 = F.pad(x.reshape(rows, self.in_features), (0, 0, 0, padding))  # one op: calls are microseconds
            out = torch.ops.mkldnn._linear_pointwise(x2, packed[1], self.bias, "none", [], "")
            return out[:rows].reshape(*x.shape[:-1], self.out_features)
        return F.linear(x, self.weight, self.bias)

    def __getstate__(self) -> dict:
        """Copies and pickles leave the packed weight behind (oneDNN's layout has no storage to copy)."""
        return {name: value for name, value in self.__dict__.items() if name != "packed"}

    def pack(self, force: bool = False) -> bool:
        """(Re)pack a stale or missing copy; False where this weight cannot be packed."""
        w = self.weight
        if w.device.type != "cpu" or w.dtype not in _PACKABLE_DTYPES:
            self.packed = None
            return False
        if force or self.packed is None or self.packed[0] != self._key():
            with torch.no_grad():
                self.packed = (self._key(), torch.ops.mkldnn._reorder_linear_weight(w.detach(), None))
                _warm(self.packed[1], w, self.bias)
        return True


def run_rows(rows: int) -> int:
    """The row count a packed call of `rows` rows runs as, zero-padded (module docstring)."""
    if rows <= _MAX_PADDED_ROWS:
        return (_row_padding or {}).get(rows, rows)
    step = 1 << (rows.bit_length() - 4)  # eight counts per doubling
    return -(-rows // step) * step


def _warm(packed: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    """Build oneDNN's kernel for every row count a call can run, once per weight shape and process."""
    key = (tuple(weight.shape), weight.dtype, bias is not None)
    if key in _warmed:
        return
    _warmed.add(key)
    for rows in sorted({run_rows(r) for r in range(1, _WARM_ROWS + 1)}):
        x = torch.zeros(rows, weight.shape[1], dtype=weight.dtype, device=weight.device)
        torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


_warned = False


def pack_linears(module: nn.Module, force: bool = False) -> int:
    """Pack every codraft Linear in `module` whose copy is missing or stale; returns how many are packed.
    Without oneDNN (or off CPU) nothing is packed and the plain path runs, with one logged line."""
    global _warned
    linears = [m for m in module.modules() if isinstance(m, Linear)]
    if not packing_available():
        if not _warned:
            log.info("oneDNN linear packing unavailable in this torch build; inference uses plain F.linear")
            _warned = True
        return 0
    row_padding()
    return sum(m.pack(force) for m in linears)


def unpack_linears(module: nn.Module) -> None:
    """Drop every packed copy (after writing weights behind autograd's back)."""
    for m in module.modules():
        if isinstance(m, Linear):
            m.packed = None
