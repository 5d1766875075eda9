"""Measured peak memory of a region of code: CUDA's allocator statistics, or live tensor bytes on CPU.

CPU has no allocator statistics, so `LiveTensorBytes` counts them itself: a TorchDispatchMode sees every
aten op (forward, autograd backward, buffers that torch.distributed calls are given) and records each
output whose storage none of the op's inputs share as a new allocation of `storage.nbytes()`; the bytes
are released when the last tensor viewing that storage dies. The peak is the maximum of the running sum.
It counts tensors allocated inside the region only (not those alive before it), and not the scratch
memory a kernel allocates and frees internally, nor the transport's own buffers.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class LiveTensorBytes(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.live = 0
        self.peak = 0
        self._storages: dict[int, list[int]] = {}  # data_ptr -> [nbytes, live tensors viewing it]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._track(t, inputs)
        return out

    def _track(self, t: torch.Tensor, inputs: set[int]) -> None:
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key == 0:  # empty storage
            return
        entry = self._storages.get(key)
        if entry is None:
            nbytes = 0 if key in inputs else storage.nbytes()  # a view of a tensor from before the region: free
            entry = self._storages[key] = [nbytes, 0]
            self.live += nbytes
            self.peak = max(self.peak, self.live)
        entry[1] += 1
        weakref.finalize(t, self._release, key)

    def _release(self, key: int) -> None:
        entry = self._storages[key]
        entry[1] -= 1
        if entry[1] == 0:
            self.live -= entry[0]
            del self._storages[key]


class PeakMemory:
    """The peak bytes above the start of the region, filled in on exit."""

    bytes: int = 0


@contextmanager
def peak_memory(device: torch.device | str = "cpu") -> Iterator[PeakMemory]:
    """`with peak_memory(device) as m: ...` then m.bytes: torch.cuda.max_memory_allocated on CUDA (above the
    allocation at entry), `LiveTensorBytes` on CPU."""
    result = PeakMemory()
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        start = torch.cuda.memory_allocated(device)
        yield result
        torch.cuda.synchronize(device)
        result.bytes = torch.cuda.max_memory_allocated(device) - start
        return
    with LiveTensorBytes() as mode:
        yield result
    result.bytes = mode.peak
