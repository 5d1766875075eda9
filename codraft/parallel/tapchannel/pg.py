"""Remote transport: each source's slot ring over a dedicated gloo group, apart from the pipeline's own.

Tag = slot, so every slot is its own in-order stream between one source and the draft stage. The draft stage keeps
a receive posted in each of its D slots (the next D microbatches); the source keeps at most D sends in flight and
reuses a slot's buffer only once the previous send from it has completed. A gloo send completes only once the
receiver has posted the matching receive, so a stalled draft stage stalls its sources, and their waits time out.

A message always carries the whole slot, so send and receive sizes match as every backend requires; the header
says how many tokens of it are valid. Waits use gloo's `Work.wait(timeout)`; gloo closes the connection after a
timed-out wait, so the channel is unusable after a TapChannelTimeout (as after any TapChannelError).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist

from codraft.parallel.tapchannel.protocol import (
    SlotLayout,
    TapChannelError,
    TapChannelTimeout,
    describe,
    ordering_fault,
    reader_timeout,
    writer_timeout,
)


def host_buffer(layout: SlotLayout) -> torch.Tensor:
    """uint8 [slot_bytes] on the host, pinned when the taps live on a GPU."""
    return torch.zeros(layout.slot_bytes, dtype=torch.uint8, pin_memory=layout.spec.device.startswith("cuda"))


def start(op: Callable[[], dist.Work], what: str) -> dist.Work:
    """Issue an isend/irecv; a peer already gone surfaces here as a TapChannelError."""
    try:
        return op()
    except RuntimeError as e:
        raise TapChannelError(f"TapChannel transport failed while {what}: {e}") from e


def await_work(work: dist.Work, timeout_s: float, timed_out: TapChannelTimeout, what: str) -> None:
    """Wait for a send/recv; raise `timed_out` when it does not complete in time, TapChannelError on a transport
    failure (typically the peer process is gone: gloo reports that at once)."""
    start = time.monotonic()
    try:
        work.wait(timeout=timedelta(seconds=timeout_s))
    except RuntimeError as e:
        if time.monotonic() - start >= timeout_s:
            raise timed_out from e
        raise TapChannelError(f"TapChannel transport failed while {what}: {e}") from e


class PgLink:
    """One source's ring of `depth` slots over gloo; `is_writer` picks the end (the source or the draft stage)."""

    def __init__(self, group: dist.ProcessGroup, source: int, draft: int, layout: SlotLayout, depth: int,
                 timeout_s: float, is_writer: bool):
        self.source, self._group, self._draft, self._layout, self._timeout_s = source, group, draft, layout, timeout_s
        self._bufs = [host_buffer(layout) for _ in range(depth)]
        self._views = [layout.views(b) for b in self._bufs]
        # per slot: the send (source) or the posted receive (draft stage), or why the receive could not be posted
        self._work: list[dist.Work | RuntimeError | None] = [None] * depth
        if not is_writer:
            for slot in range(depth):
                self._post_recv(slot)

    def _post_recv(self, slot: int) -> None:
        try:
            self._work[slot] = dist.irecv(self._bufs[slot], group=self._group, group_src=self.source, tag=slot)
        except RuntimeError as e:  # the source has closed its end: a fault only if this slot is fetched again
            self._work[slot] = e

    def post(self, slot: int, value: int, taps: list[torch.Tensor], tokens: int) -> None:
        if (work := self._work[slot]) is not None:  # the buffer is reusable once its previous send completed
            await_work(work, self._timeout_s, writer_timeout(self.source, slot, value, self._timeout_s),
                       f"source stage {self.source} sent slot {slot} before posting {describe(value)}")
        header, data = self._views[slot]
        self._layout.write(data, taps, tokens)
        header.copy_(torch.tensor([value, tokens]))
        self._work[slot] = start(lambda: dist.isend(self._bufs[slot], group=self._group, group_dst=self._draft,
                                                    tag=slot), f"source stage {self.source} sent {describe(value)}")

    def fetch(self, slot: int, expected: int) -> torch.Tensor:
        if isinstance(work := self._work[slot], RuntimeError):
            raise TapChannelError(f"TapChannel: the draft stage could not receive {describe(expected)} from source "
                                  f"stage {self.source} (slot {slot}): {work}") from work
        await_work(work, self._timeout_s, reader_timeout(self.source, slot, expected, self._timeout_s),
                   f"the draft stage received {describe(expected)} from source stage {self.source} (slot {slot})")
        header, data = self._views[slot]
        found, tokens = header.tolist()
        if found != expected:
            raise ordering_fault(self.source, slot, expected, found)
        taps = self._layout.read(data, tokens)
        self._post_recv(slot)  # the slot is free again: receive the microbatch `depth` ahead into it
        return taps

    def drain(self) -> None:
        """Source end only: wait until the draft stage has taken every post still in flight."""
        for slot, work in enumerate(self._work):
            if work is not None:
                timed_out = TapChannelTimeout(f"TapChannel timeout: source stage {self.source} waited "
                                              f"{self._timeout_s:g} s for the draft stage to take slot {slot}")
                await_work(work, self._timeout_s, timed_out, f"source stage {self.source} drained slot {slot}")
                self._work[slot] = None

    def close(self) -> None:
        self._work = []  # pending receives die with the group, which the channel destroys
