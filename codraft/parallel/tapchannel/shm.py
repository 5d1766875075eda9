"""Colocated transport: each source's slot ring lives in a shared-memory segment mapped by both stages.

CPU only. On GPU the same protocol would keep the ring in device memory shared through CUDA IPC handles; that path
is not implemented, and TapChannel refuses it at construction.

Memory ordering: the writer stores the taps, then the length, then the stamp; the reader loads the stamp, then the
taps, then stores FREE. On x86-64 (TSO) stores become visible to other cores in program order and a later store
never passes an earlier load, so this needs no fence; a copy_ fanned out to worker threads ends in their join,
whose locked instructions publish their stores first. Stamps are aligned 8-byte words, read and written whole.
Weakly ordered CPUs (ARM) would need acquire/release fences that Python cannot issue, so TapChannel only picks this
transport on x86-64.
"""

from __future__ import annotations

import logging
import sys
from multiprocessing import resource_tracker
from multiprocessing.shared_memory import SharedMemory

import torch
import torch.distributed as dist

from codraft.parallel.tapchannel.protocol import (
    FREE,
    SlotLayout,
    TapChannelError,
    ordering_fault,
    poll,
    reader_timeout,
    writer_timeout,
)

log = logging.getLogger(__name__)


class ShmLink:
    """One source's ring of `depth` slots in a shared-memory segment; the same object serves either end."""

    def __init__(self, segment: SharedMemory, source: int, layout: SlotLayout, depth: int, timeout_s: float):
        self.source, self._segment, self._layout, self._timeout_s = source, segment, layout, timeout_s
        self._words = layout.slot_bytes // 8
        self._header = segment.buf.cast("q")  # int64 words: slot i's stamp at i * words, its length right after
        slots = torch.frombuffer(segment.buf, dtype=torch.uint8, count=depth * layout.slot_bytes).view(depth, -1)
        self._data = [layout.views(row)[1] for row in slots]  # per slot [n_layers, max_tokens, hidden]

    def post(self, slot: int, value: int, taps: list[torch.Tensor], tokens: int) -> None:
        at = slot * self._words
        if not poll(lambda: self._header[at] == FREE, self._timeout_s):
            raise writer_timeout(self.source, slot, value, self._timeout_s)
        self._layout.write(self._data[slot], taps, tokens)
        self._header[at + 1] = tokens
        self._header[at] = value  # last: publishes the slot (x86 TSO, see the module docstring)

    def fetch(self, slot: int, expected: int) -> torch.Tensor:
        at = slot * self._words
        if not poll(lambda: self._header[at] != FREE, self._timeout_s):
            raise reader_timeout(self.source, slot, expected, self._timeout_s)
        if (found := self._header[at]) != expected:
            raise ordering_fault(self.source, slot, expected, found)
        taps = self._layout.read(self._data[slot], self._header[at + 1])
        self._header[at] = FREE  # only after the copy: the writer may refill the slot from here on
        return taps

    def drain(self) -> None:
        """Nothing in flight: a post is complete once its stamp is stored."""

    def close(self) -> None:
        self._data = []
        self._header.release()
        try:
            self._segment.close()
        except BufferError:  # a traceback still holds a slot view; the mapping goes when that is freed
            log.debug("TapChannel shm segment of source stage %d stays mapped until its views are freed", self.source)


def _attach(name: str) -> SharedMemory:
    """Map a segment that the draft stage owns (and unlinks). Attaching must not register it with the resource
    tracker as if this process owned it: at exit the tracker would unlink it again and warn of a leak per channel.
    Python 3.13 says so with track=False; before, registration is switched off around the attach."""
    if sys.version_info >= (3, 13):
        return SharedMemory(name=name, track=False)
    register = resource_tracker.register
    resource_tracker.register = lambda *args: None
    try:
        return SharedMemory(name=name)
    finally:
        resource_tracker.register = register


def open_shm_links(group: dist.ProcessGroup, stage: int, draft: int, rings: dict[int, tuple[SlotLayout, int]],
                   timeout_s: float) -> dict[int, ShmLink]:
    """Collective on `group`: the draft stage creates one segment per source in `rings` ({source: (layout, depth)}),
    each source maps its own, and once every source has mapped it the draft stage unlinks the names, so no segment
    outlives the processes, even killed ones. Returns this stage's links (all of them on the draft stage)."""
    created: dict[int, SharedMemory] = {}
    links: dict[int, ShmLink] = {}
    error = None
    try:
        if stage == draft:
            try:
                for s, (layout, depth) in rings.items():
                    created[s] = SharedMemory(create=True, size=depth * layout.slot_bytes)  # zero-filled: all FREE
            except OSError as e:
                error = f"draft stage {stage} could not create a shared-memory segment: {e}"
        names: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(names, ({s: m.name for s, m in created.items()}, error), group=group)
        segment_names, draft_error = names[draft]
        if draft_error is None and stage in rings:
            try:
                links[stage] = ShmLink(_attach(segment_names[stage]), stage, *rings[stage], timeout_s)
            except OSError as e:  # e.g. the stages do not share /dev/shm after all
                error = f"source stage {stage} could not map segment {segment_names[stage]!r}: {e}"
        errors: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(errors, error, group=group)
    finally:
        for segment in created.values():
            segment.unlink()  # every source has mapped it (or failed): the name is no longer needed
    if failures := [e for e in errors if e is not None]:
        for link in links.values():
            link.close()
        for segment in created.values():
            segment.close()
        raise TapChannelError("TapChannel shm setup failed: " + "; ".join(failures))
    if stage == draft:
        links = {s: ShmLink(m, s, *rings[s], timeout_s) for s, m in created.items()}
    return links
