"""The TapChannel slot protocol: stamps, slot layout, errors, and the ring depth a schedule needs.

Each source stage owns a ring of `depth` slots towards the draft stage. Microbatch m of training step k goes to
slot m % depth under the stamp `stamp(k, m)`; FREE (0) marks an empty slot. The writer waits until its slot is
free, writes the taps and their length, then publishes the stamp; the reader waits for a stamp, checks it is
exactly the expected one, copies the taps out, then frees the slot. Any other stamp is an ordering fault.

Numbering: microbatches restart at 0 every training step and `TapChannel.reset()` advances a local step counter
that is part of the stamp, so a slot left over from an earlier step can never pass for the current one.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

FREE = 0
HEADER_BYTES = 64  # [stamp, length] int64, padded to a cache line so no two slots' stamps share one
_ALIGN = 64
_MB_BITS = 32


class TapChannelError(RuntimeError):
    """An ordering fault, a misshapen post or a broken transport; the channel cannot be used afterwards."""


class TapChannelTimeout(TapChannelError):
    """A bounded wait ran out: the peer stage is dead or stalled."""


def stamp(step: int, microbatch: int) -> int:
    """The stamp of microbatch `microbatch` of training step `step`; never FREE."""
    assert 0 <= microbatch < 2**_MB_BITS - 1 and 0 <= step < 2**31, (step, microbatch)
    return (step << _MB_BITS) | (microbatch + 1)


def describe(value: int) -> str:
    if value == FREE:
        return "nothing (free slot)"
    return f"step {value >> _MB_BITS} microbatch {(value & (2**_MB_BITS - 1)) - 1}"


def ordering_fault(source: int, slot: int, expected: int, found: int) -> TapChannelError:
    return TapChannelError(f"TapChannel ordering fault: source stage {source}, slot {slot}: expected "
                           f"{describe(expected)} but found {describe(found)} (a re-ordered, duplicated or lost post)")


def reader_timeout(source: int, slot: int, expected: int, timeout_s: float) -> TapChannelTimeout:
    return TapChannelTimeout(f"TapChannel timeout: the draft stage waited {timeout_s:g} s for source stage {source} "
                             f"to post {describe(expected)} (slot {slot}); is stage {source} dead or stalled?")


def writer_timeout(source: int, slot: int, value: int, timeout_s: float) -> TapChannelTimeout:
    return TapChannelTimeout(f"TapChannel timeout: source stage {source} waited {timeout_s:g} s for the draft stage "
                             f"to take slot {slot} before posting {describe(value)}; is the draft stage dead or "
                             f"stalled, or is the ring too shallow for the schedule?")


def required_depth(schedule_name: str, stage: int, pp: int, n_microbatches: int) -> int:
    """Slots a source at `stage` needs so that it never waits for the last stage to fetch.

    1F1B: stage s runs pp - 1 - s warm-up forwards ahead of the last stage plus the one in flight, so pp - s.
    GPipe: all forwards precede any backward, so a source can post every microbatch before the first fetch.
    """
    name = schedule_name.lower().removeprefix("schedule")
    if name not in ("1f1b", "gpipe"):
        raise ValueError(f"schedule_name={schedule_name!r}: TapChannel knows the run-ahead of '1F1B' and 'GPipe' "
                         "(interleaved schedules: pass depth explicitly)")
    if not 0 <= stage < pp:
        raise ValueError(f"stage={stage} is outside the pipeline [0, {pp})")
    if n_microbatches < 1:
        raise ValueError(f"n_microbatches={n_microbatches} must be >= 1")
    return min(pp - stage, n_microbatches) if name == "1f1b" else n_microbatches


@dataclass(frozen=True)
class TapSpec:
    """Taps of one microbatch: per tap layer a [tokens, hidden] tensor with tokens <= max_tokens."""

    max_tokens: int
    hidden: int
    dtype: torch.dtype = torch.bfloat16
    device: str = "cpu"  # where fetch() delivers the taps

    def __post_init__(self):
        if self.max_tokens < 1 or self.hidden < 1:
            raise ValueError(f"TapSpec(max_tokens={self.max_tokens}, hidden={self.hidden}) must both be >= 1")


@dataclass(frozen=True)
class SlotLayout:
    """Bytes of one slot: a HEADER_BYTES header, then the taps [n_layers, max_tokens, hidden]."""

    spec: TapSpec
    n_layers: int

    @property
    def slot_bytes(self) -> int:
        data = self.n_layers * self.spec.max_tokens * self.spec.hidden * self.spec.dtype.itemsize
        return HEADER_BYTES + math.ceil(data / _ALIGN) * _ALIGN

    def views(self, slot: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """uint8 [slot_bytes] -> header int64 [2] (stamp, length), data [n_layers, max_tokens, hidden]."""
        s = self.spec
        n = self.n_layers * s.max_tokens * s.hidden * s.dtype.itemsize
        data = slot[HEADER_BYTES:HEADER_BYTES + n].view(s.dtype).view(self.n_layers, s.max_tokens, s.hidden)
        return slot[:16].view(torch.int64), data

    def write(self, data: torch.Tensor, taps: list[torch.Tensor], tokens: int) -> None:
        for j, t in enumerate(taps):  # t [tokens, hidden]
            data[j, :tokens].copy_(t)

    def read(self, data: torch.Tensor, tokens: int) -> torch.Tensor:
        """A copy of the first `tokens` rows of every layer: [n_layers, tokens, hidden]."""
        assert 0 <= tokens <= self.spec.max_tokens, tokens  # both ends checked the spec agrees at construction
        return data[:, :tokens].clone()


def poll(ready: Callable[[], bool], timeout_s: float) -> bool:
    """Wait until `ready()` holds (True) or `timeout_s` passes (False), backing off to 1 ms between checks."""
    deadline = time.monotonic() + timeout_s
    pause = 1e-5
    while not ready():
        if time.monotonic() >= deadline:
            return ready()
        time.sleep(pause)
        pause = min(2 * pause, 1e-3)
    return True
