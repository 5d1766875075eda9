"""nn.Linear that, outside autograd, can run on a packed copy of its weight (codraft's kernel or oneDNN's).

Rollout forwards on CPU feed 1 to a few dozen rows. MKL's fp32 GEMM at 2-8 rows
costs 1.5-2x its 1-row GEMV on this machine, so a verify forward of k+1 tokens
cost far more than a decode step. oneDNN's kernel over a weight reordered once
into its blocked layout reads the weight once at any small row count (measured
on SmolLM2-135M's 211 matmuls: 1 row 45 -> 25 ms, 4 rows 61 -> 28 ms, 32 rows
108 -> 55 ms). A row's output is not always bitwise the same at every row count: with torch 2.13 on
this host, a 1536-input weight (SmolLM2's down projection) rounded a row differently alone than beside
others (up to ~1e-4; the same at 2 to 64 rows), so a decode step and a verify forward can differ in the last
bits: greedy speculation equals plain decoding but at near-ties of the argmax (every bench so far gave the
same greedy tokens).

Where codraft's own AVX-512 kernels build (`cpu_kernels.py`), fp32 copies are its panels instead: it read
SmolLM2-135M's weights at 1-8 rows in 0.50-0.62x oneDNN's time, and a row's output is bitwise the same at every
row count. So are bf16 copies on a CPU without AMX: with AVX-512 BF16, activations rounded to bf16 and bf16 dot
products summed in fp32 (`bf16_gemm`); else bf16 weights widened to fp32 in registers, fp32 activations and sums
(half the bytes of an fp32 copy: SmolLM2's matmuls at 1 / 8 / 16 rows in 0.52 / 0.82 / 0.96x the fp32 kernel's
time). bf16 copies with AMX, and every copy where the kernels do not build, stay oneDNN's, as below.

`pack_linears(module)` makes the copies (one per Linear or FusedLinears group,
the weights' versions and addresses recorded); a copy is used only while autograd
is off and its weights are unchanged, so training forwards and gradients never see
it, and an optimizer step (in place, so it bumps the version) or a `.to()` makes
the copy stale until the next pack.
Writes that bypass the version counter (`dist.broadcast` into `.data`) must
bump it (`torch.autograd.graph.increment_version`, as `parallel.collectives.broadcast_in_place` does)
or call `unpack_linears` or `pack_linears(..., force=True)`.

`FusedLinears` groups linears that read the same input (q/k/v, gate/up): their
weights are packed side by side and run as one matmul. A copy may be in another
dtype than its weights (`pack_linears(..., dtype=torch.bfloat16)`, the rollout matmuls
of `model.inference_dtype` and `draft.inference_dtype`): inputs are cast to the copy's dtype and outputs back.
A Linear marked `keep_dtype` (a policy's lm_head: logits and log-probs at the weights' precision) keeps its own.

A draft's copies may also be int8 (`draft.inference_dtype`, auto where the CPU has PyTorch's x86/fbgemm quantized
engine): weights quantized per output channel, activations per call (one scale for the call's whole input, 7-bit),
run by `quantized::linear_dynamic`, fp32 in and out. A draft's chain step at 1-8 rows reads half a bf16 copy's bytes,
and on the Intel AMX host its five matmuls took 215 instead of 503 us a token at one row (a loop over all five, so
none stays in cache), the whole draft step 0.75-0.82x its bf16 time at 1-8 rows, with acceptance (k = 7, 32
held-out chain prompts) 3.22 vs 3.18 at T=0 and 2.16 vs 2.21 at T=1 (mean of 4 seeds). A row's output depends on
the other rows of its call (the shared activation scale: one row's outlier coarsens the others', one row's inf makes
the whole call NaN), so it is for drafts only: verification uses the distribution a draft drew from, whatever
computed it, and a NaN proposal is rejected (it costs speed, never tokens). A Linear marked `raw_input` (tap fusion:
the policy's residual stream, whose few huge dimensions would take a shared scale's whole range) is packed in bf16
(or its own dtype) instead.

A bf16 copy runs calls of more than 32 rows as slices of 32. oneDNN's bf16 kernels (AMX on the Intel host) sum in
another order above 32 rows, and a bf16 output rounds that difference to a whole bf16 step: the same row of
SmolLM2's down projection came out 1e-3 apart alone and among 40 rows, and its logits up to 0.35 apart, where up
to 32 rows it is bitwise what it is alone. Sliced, a row's output never depends on its call's other rows there,
so greedy speculation gives plain decoding's tokens; the price is reading the weight once per slice.

On an AMD AVX-512 BF16 host without AMX, oneDNN's bf16 rollouts are not shape-invariant, sliced or not: a 1536-input
kernel rounds about one output in 10,000 differently in a 1-row call than among 2-32 rows, and with that padded
away, the fp32 differences left between a decode step and a verify forward (attention over other numbers of keys
and queries; ~1e-6) still flip an activation's rounding where it is cast to bf16, a bf16 step the next layers
carry: a decode step's logits and a 5-token verify's for the same token were 0.1 apart (fp32 copies: 3e-5).
Plain greedy decoding at batch 8 and 32 gave other tokens than each prompt alone in 1 of 8 and 2 of 32 rows, and
greedy speculation other tokens than plain decoding in 2 of 8 and 6 of 32 (all at near-ties, 0.002-0.1 apart in
the logits); in fp32 every row was the same. On codraft's kernels a row's matmuls and its queries' attention
(cache_attention.py) are bitwise the same at every shape, so a decode step and a verify forward compute a token
alike, bf16 activations included: a row's greedy tokens alone, in a batch of 8 and under speculation are the same
(test_smollm2_parity.py), and a verify forward's logits are its decode steps' bit for bit (test_model.py; with the
grouped matmuls' attention they were up to 0.02 apart). So `packed_dtype(..., exact=True)`, the policy's, is
bfloat16 under `auto` where bf16 copies are shape-invariant (`bf16_shape_invariant`: codraft's kernels, or oneDNN's
with AMX). On the AMD host, SmolLM2's forwards with bf16 activations (and the kernel's attention) took 0.90x the
time of bf16 weights over fp32 activations (and grouped attention) in a batch-1 decode step, 0.71-0.73x in batch-1
verify forwards of 4-8 tokens, 0.68-0.78x at batch 8 and 0.67-0.69x at batch 32 (stop 63, an in-process A/B with
the arms interleaved forward by forward, medians of 10, a one-off script): past ~8 rows bf16 weights
widened to fp32 were bound by fp32 fma throughput, where a bf16 dot product does two multiply-adds a lane.
Drafts need no exactness (verification uses the distribution they drew from).

Calls of up to 8 rows run as they are. Single oneDNN matmuls of 1-2 rows run a slower path than of 3-6, but
padding decode and verify calls up to 5-6 rows measured 0.96-1.08x on SmolLM2's whole forward (in-process
A/B, 1-4 rows x 1-4 tokens): the padding's own ops take what the kernel gains.

oneDNN also builds (JIT-compiles) and keeps a kernel per row count met, about 0.5 MiB each, and the rollout's
row counts vary from step to step (rows still decoding, times k+1 in a verify, a prefill's prompt tokens): the
soak's resident memory grew for ~60 steps as new counts appeared (+11% from step 10 to 60). So a packed call
runs zero-padded to one of eight row counts per doubling above 8 rows (`run_rows`; under 1/8 of its rows are
padding, which costs SmolLM2-sized matmuls a few percent), and the first pack of each weight shape builds the
kernels of all 48 counts up to 256 (`_warm`: about 2.7 s once for SmolLM2-135M, most of it lm_head). Memory then
stops growing at the start, but for the few counts of longer prefills.
"""

from __future__ import annotations

import functools
import logging
import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from codraft.models.cpu_kernels import cpu_kernels, gemm, pack_panels, panel_kind

log = logging.getLogger(__name__)

_PACKABLE_DTYPES = (torch.float32, torch.bfloat16)
_INT8_REDUCE_RANGE = True  # 7-bit activations: fbgemm's int16 accumulation cannot saturate on AVX2-only cores
_UNPADDED_ROWS = 8  # calls of up to this many rows run as they are
_WARM_ROWS = 256  # `_warm` builds the kernels of the row counts up to this
_BF16_ROWS = 32  # bf16 calls of more rows run in slices of this many (module docstring)
_warmed: set[tuple] = set()  # the weight shapes whose kernels `_warm` has built in this process
_logged: set[str] = set()  # the messages `_log_once` has logged in this process


def _log_once(level: int, message: str) -> None:
    if message not in _logged:
        log.log(level, message)
        _logged.add(message)


def packing_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


@functools.cache  # read at every rollout's packing; the CPU does not change
def native_bf16() -> bool:
    """The CPU has bf16 arithmetic (AVX-512 BF16 or AMX). oneDNN also runs bf16 on any AVX-512 core
    (`_is_mkldnn_bf16_supported`), but by emulation, where it is slower than fp32."""
    return torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()


@functools.cache
def bf16_packing_available() -> bool:
    """oneDNN can reorder and run a bf16 linear on this CPU at all (AVX-512 BW/VL/DQ or AVX-NE-CONVERT): on an
    AVX2-only core its reorder raises."""
    return packing_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def bf16_native_linear() -> bool:
    """oneDNN runs bf16 linears on this CPU's own bf16 arithmetic: where bf16 copies and bf16 training matmuls pay."""
    return native_bf16() and bf16_packing_available()


@functools.cache
def int8_packing_available() -> bool:
    """PyTorch's x86 (fbgemm) quantized engine is there to run int8 dynamic linears on this CPU."""
    engines = torch.backends.quantized.supported_engines
    return hasattr(torch, "quantize_per_channel") and any(engine in engines for engine in ("x86", "fbgemm"))


@functools.cache
def amx() -> bool:
    """The CPU has AMX: bf16 copies run on oneDNN's AMX kernel, elsewhere on codraft's where it loads."""
    return torch.cpu._is_amx_tile_supported()


def bf16_shape_invariant() -> bool:
    """bf16 copies give a row the same logits whatever the shape of its forward (decode step, verify forward,
    batch size): on codraft's kernels (one chain of fmas or bf16 dot products per output, attention one query at a
    time) and on oneDNN's with AMX (the Intel host: greedy speculation equalled plain decoding in every row of every
    bench); not on oneDNN's on AVX-512 BF16 without AMX (module docstring)."""
    return amx() or cpu_kernels() is not None


def _on_codraft_kernel(dtype: torch.dtype) -> bool:
    """A copy in `dtype` runs on codraft's kernel (cpu_kernels.py): fp32 wherever it loads, bf16 where it loads and
    the CPU has no AMX (there oneDNN's AMX kernel runs activations in bf16 too, measured as it is)."""
    if cpu_kernels() is None:
        return False
    return dtype == torch.float32 or (dtype == torch.bfloat16 and not amx())


def packed_dtype(setting: str, weights: torch.dtype, exact: bool = False) -> torch.dtype:
    """The dtype of packed copies for a setting "auto" | "float32" | "bfloat16" | "int8": auto is, for copies that
    need not be `exact`, int8 where the quantized engine runs it, and bfloat16 where oneDNN runs it on native bf16
    arithmetic; for `exact` copies (a policy's: verification must compute what a decode step computes) never int8, and
    bfloat16 only where that is also shape-invariant; else the weights' own dtype. bfloat16 (or int8) is the
    weights' own dtype too where this CPU has no such linear at all, with one logged line; int8 is refused for
    `exact` copies."""
    if setting == "auto":
        if not exact and packing_available() and int8_packing_available():
            return torch.int8
        bf16 = bf16_native_linear() and (bf16_shape_invariant() or not exact)
        return torch.bfloat16 if bf16 else weights
    if setting == "int8" and exact:
        raise ValueError("int8 copies give a row other outputs beside other rows; a policy's must be exact")
    return _runnable(getattr(torch, setting), weights)


def _runnable(dtype: torch.dtype | None, fallback: torch.dtype | None) -> torch.dtype | None:
    """`dtype` for packed copies, or `fallback` (with one logged line) where this CPU cannot run it."""
    if dtype == torch.bfloat16 and not bf16_packing_available():
        _log_once(logging.WARNING, "bf16 inference matmuls asked for (inference_dtype), but oneDNN has no bf16 "
                  "linear on this CPU (it needs AVX-512 BW/VL/DQ or AVX-NE-CONVERT): they run in the weights' dtype")
        return fallback
    if dtype == torch.int8 and not int8_packing_available():
        _log_once(logging.WARNING, "int8 inference matmuls asked for (inference_dtype), but this torch build has no "
                  "x86/fbgemm quantized engine: they run in the weights' dtype")
        return fallback
    return dtype


def _float_dtype(dtype: torch.dtype | None) -> torch.dtype | None:
    """What a `raw_input` Linear is packed in when int8 is asked: bf16 where that is native, else its own dtype."""
    if dtype != torch.int8:
        return dtype
    return torch.bfloat16 if bf16_native_linear() else None


@dataclass
class PackedWeight:
    """A oneDNN-reordered copy of one or more weights side by side (or fbgemm's int8 one), and what it was made
    from."""

    key: tuple  # the source weights' (version, address) and the copy's dtype
    weight: torch.Tensor | None  # oneDNN's layout, or cpu_kernels' panels (None for an int8 copy)
    bias: torch.Tensor | None  # in the copy's dtype
    int8: torch.ScriptObject | None = None  # quantized::linear_prepack of the int8 weights and the fp32 bias
    native: bool = False  # `weight` is fp32 or bf16 panels for codraft's own kernel (cpu_kernels.py), `bias` fp32

    @property
    def dtype(self) -> torch.dtype:
        return torch.int8 if self.int8 is not None else self.weight.dtype


def _pack(weights: list[torch.Tensor], biases: list[torch.Tensor | None], dtype: torch.dtype | None,
          key: tuple) -> PackedWeight:
    """Reorder `weights` (stacked along their outputs) into a copy in `dtype` (default: theirs)."""
    if dtype == torch.int8:
        return _pack_int8(weights, biases, key)
    with torch.no_grad():
        dtype = dtype or weights[0].dtype
        weight = torch.cat([w.detach() for w in weights]).to(dtype)
        bias = None
        if any(b is not None for b in biases):
            bias = torch.cat([b.detach() if b is not None else w.new_zeros(w.shape[0])
                              for w, b in zip(weights, biases, strict=True)]).float()
        if _on_codraft_kernel(dtype):  # fp32 bias: the kernel adds it to its fp32 sums
            return PackedWeight(key, pack_panels(weight), bias, native=True)
        packed = PackedWeight(key, torch.ops.mkldnn._reorder_linear_weight(weight, None),
                              None if bias is None else bias.to(dtype))
        _warm(packed, weight)
    return packed


def _pack_int8(weights: list[torch.Tensor], biases: list[torch.Tensor | None], key: tuple) -> PackedWeight:
    """Symmetric per-output-channel int8 weights (scale = the row's largest magnitude / 127), prepacked for fbgemm."""
    with torch.no_grad():
        weight = torch.cat([w.detach() for w in weights]).float()
        scale = (weight.abs().amax(1) / 127).clamp(min=1e-12).double()
        zero = torch.zeros(weight.shape[0], dtype=torch.long)
        with warnings.catch_warnings():  # quantized tensors are deprecated upstream; the pinned torch has them
            warnings.filterwarnings("ignore", message=".*quantized tensor creation functions.*")
            quantized = torch.quantize_per_channel(weight, scale, zero, 0, torch.qint8)
        bias = None
        if any(b is not None for b in biases):
            bias = torch.cat([b.detach() if b is not None else w.new_zeros(w.shape[0])
                              for w, b in zip(weights, biases, strict=True)]).float()
        return PackedWeight(key, None, None, torch.ops.quantized.linear_prepack(quantized, bias))


def _run_packed(x: torch.Tensor, packed: PackedWeight, out_features: int) -> torch.Tensor:
    """x [..., in] through a packed copy -> [..., out] in x's dtype (a bf16 or int8 copy of fp32 weights runs its
    matmul in that dtype and hands back fp32)."""
    if packed.int8 is not None:
        flat = x.reshape(-1, x.shape[-1])
        out = torch.ops.quantized.linear_dynamic(flat.float(), packed.int8, _INT8_REDUCE_RANGE)
        return out.reshape(*x.shape[:-1], out_features).to(x.dtype)
    if packed.native:
        return gemm(x.float(), packed.weight, packed.bias, out_features).to(x.dtype)
    dtype = packed.weight.dtype
    rows = x.numel() // x.shape[-1]
    xin = x if x.dtype == dtype else x.to(dtype)
    if dtype == torch.bfloat16 and rows > _BF16_ROWS:
        flat = xin.reshape(rows, x.shape[-1])
        out = torch.cat([_run_packed(flat[i : i + _BF16_ROWS], packed, out_features)
                         for i in range(0, rows, _BF16_ROWS)])
        return out.reshape(*x.shape[:-1], out_features).to(x.dtype)
    padding = run_rows(rows) - rows
    if not padding:
        out = torch.ops.mkldnn._linear_pointwise(xin, packed.weight, packed.bias, "none", [], "")
    else:
        x2 = F.pad(xin.reshape(rows, x.shape[-1]), (0, 0, 0, padding))  # one op: calls are microseconds
        out = torch.ops.mkldnn._linear_pointwise(x2, packed.weight, packed.bias, "none", [], "")
        out = out[:rows].reshape(*x.shape[:-1], out_features)
    return out if out.dtype == x.dtype else out.to(x.dtype)


def _usable(packed: PackedWeight | None, key: tuple) -> bool:
    return packed is not None and not torch.is_grad_enabled() and packed.key[:-1] == key


def _packable(w: torch.Tensor) -> bool:
    return w.device.type == "cpu" and w.dtype in _PACKABLE_DTYPES


class Linear(nn.Linear):
    """nn.Linear (same parameters and state dict) with an optional packed weight for inference."""

    packed: PackedWeight | None = None
    keep_dtype = False  # packed in its weight's own dtype whatever `pack_linears` asks (a policy's logits)
    raw_input = False  # reads the policy's residual stream: packed in a float dtype when int8 is asked

    def _key(self) -> tuple[int, int]:
        """Changes when the weight does: in-place updates bump the version, `.to()`/`.data =` move the storage."""
        return self.weight._version, self.weight.data_ptr()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if _usable(self.packed, (self._key(),)):
            return _run_packed(x, self.packed, self.out_features)
        return F.linear(x, self.weight, self.bias)

    def __getstate__(self) -> dict:
        """Copies and pickles leave the packed weight behind (oneDNN's layout has no storage to copy)."""
        return {name: value for name, value in self.__dict__.items() if name != "packed"}

    def pack(self, force: bool = False, dtype: torch.dtype | None = None) -> bool:
        """(Re)pack a stale or missing copy, in `dtype` (default: the weight's); False where this weight cannot
        be packed."""
        return _refresh(self, [self.weight], [self.bias], (self._key(),), force, dtype)


class FusedLinears:
    """Linears that read the same input (q/k/v, gate/up), run as one packed matmul outside autograd.

    One call instead of two or three: fewer kernel launches and one pass over the input (SmolLM2's
    projections: 3-4 ms less of a 20-24 ms decode step's matmuls, measured). Not a Module: the members stay
    the parameters, state-dict entries and gradients they are; this holds a packed copy of their weights side
    by side, current while none of them changed. Without one (training, no oneDNN) each member runs alone.
    A Linear in a group is only called through its groups, so `pack_linears` packs the groups, not it.
    """

    packed: PackedWeight | None = None

    def __init__(self, *linears: Linear):
        self.linears = linears
        self.sizes = [m.out_features for m in linears]

    def _key(self) -> tuple:
        return tuple(m._key() for m in self.linears)

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if _usable(self.packed, self._key()):
            return _run_packed(x, self.packed, sum(self.sizes)).split(self.sizes, -1)
        return tuple(m(x) for m in self.linears)

    def __getstate__(self) -> dict:
        """Copies (a deepcopied module's groups hold the copied members) leave the packed weight behind."""
        return {"linears": self.linears, "sizes": self.sizes}

    def pack(self, force: bool = False, dtype: torch.dtype | None = None) -> bool:
        return _refresh(self, [m.weight for m in self.linears], [m.bias for m in self.linears], self._key(), force,
                        dtype)


def _refresh(owner: Linear | FusedLinears, weights: list[torch.Tensor], biases: list[torch.Tensor | None],
             source_key: tuple, force: bool, dtype: torch.dtype | None) -> bool:
    """Give `owner` a current packed copy of `weights` in `dtype` (default: theirs), made anew only when missing,
    stale or of another dtype; False (and no copy) where they cannot be packed."""
    if not all(_packable(w) for w in weights):
        owner.packed = None
        return False
    key = (*source_key, dtype or weights[0].dtype)
    if force or owner.packed is None or owner.packed.key != key:
        owner.packed = _pack(weights, biases, dtype, key)
    return True


def run_rows(rows: int) -> int:
    """The row count a packed call of `rows` rows runs as, zero-padded (module docstring)."""
    if rows <= _UNPADDED_ROWS:
        return rows
    step = 1 << (rows.bit_length() - 4)  # eight counts per doubling
    return -(-rows // step) * step


def _warm(packed: PackedWeight, weight: torch.Tensor) -> None:
    """Build oneDNN's kernel for every row count a call can run, once per weight shape and process."""
    key = (tuple(weight.shape), weight.dtype, packed.bias is not None)
    if key in _warmed:
        return
    _warmed.add(key)
    most = _BF16_ROWS if weight.dtype == torch.bfloat16 else _WARM_ROWS
    for rows in sorted({run_rows(r) for r in range(1, most + 1)}):
        x = torch.zeros(rows, weight.shape[1], dtype=weight.dtype, device=weight.device)
        torch.ops.mkldnn._linear_pointwise(x, packed.weight, packed.bias, "none", [], "")


def pack_linears(module: nn.Module, force: bool = False, dtype: torch.dtype | None = None) -> int:
    """Pack every codraft Linear and FusedLinears group in `module` whose copy is missing, stale or of another
    dtype than `dtype` (default: the weights' own; a Linear with `keep_dtype` always its own, one with `raw_input`
    a float one); returns how many are packed. Without oneDNN (or off CPU) nothing is packed and the plain path
    runs, and where this CPU has no bf16 (int8) linear a bf16 (int8) `dtype` packs in the weights' own: one logged
    line each, never a crash."""
    if not packing_available():
        _log_once(logging.INFO, "oneDNN linear packing unavailable in this torch build; inference uses plain F.linear")
        return 0
    dtype = _runnable(dtype, None)
    groups = _groups(module)
    grouped = {id(m) for g in groups for m in g.linears}
    count = 0
    for m in module.modules():
        if isinstance(m, Linear):
            if id(m) in grouped:
                m.packed = None  # runs through its groups
            else:
                count += m.pack(force, None if m.keep_dtype else _float_dtype(dtype) if m.raw_input else dtype)
    return count + sum(g.pack(force, dtype) for g in groups)


def packed_weight_bytes(module: nn.Module) -> int:
    """Bytes of `module`'s weights a forward reads: each parameter once, a packed one in its copy's dtype."""
    copy_size = {id(m.weight): m.packed.dtype.itemsize
                 for m in module.modules() if isinstance(m, Linear) and m.packed is not None}
    for g in _groups(module):
        if g.packed is not None:
            copy_size |= {id(m.weight): g.packed.dtype.itemsize for m in g.linears}
    return sum(p.numel() * copy_size.get(id(p), p.element_size()) for p in module.parameters())


def packed_kernels(module: nn.Module) -> list[str]:
    """What `module`'s packed copies run on (a bench's record): codraft_fp32, codraft_bf16 (bf16 activations and
    dot products), codraft_bf16_weights (fp32 activations), onednn_<dtype>, fbgemm_int8."""
    names = {"fp32": "codraft_fp32", "bf16": "codraft_bf16", "bf16w": "codraft_bf16_weights"}

    def kernel(p: PackedWeight) -> str:
        if p.native:
            return names[panel_kind(p.weight)]
        return "fbgemm_int8" if p.int8 is not None else f"onednn_{str(p.dtype).removeprefix('torch.')}"

    copies = [m.packed for m in module.modules() if isinstance(m, Linear)] + [g.packed for g in _groups(module)]
    return sorted({kernel(p) for p in copies if p is not None})


def unpack_linears(module: nn.Module) -> None:
    """Drop every packed copy (after writing weights behind autograd's back)."""
    for m in module.modules():
        if isinstance(m, Linear):
            m.packed = None
    for g in _groups(module):
        g.packed = None


def _groups(module: nn.Module) -> list[FusedLinears]:
    return [g for m in module.modules() for g in vars(m).values() if isinstance(g, FusedLinears)]
