"""Baseline transport for comparison: one host staging buffer and a blocking send/recv inside post/fetch.

No ring and no run-ahead: post() returns only once the draft stage's fetch() has received the taps (a gloo send
completes when the matching receive is posted), so a source waits for the last stage at every microbatch.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from codraft.parallel.tapchannel.pg import await_work, host_buffer, start
from codraft.parallel.tapchannel.protocol import (
    SlotLayout,
    describe,
    ordering_fault,
    reader_timeout,
    writer_timeout,
)


class HostStagingLink:
    """One source's staging buffer (slot 0 of a ring of depth 1) on the source or on the draft stage."""

    def __init__(self, group: dist.ProcessGroup, source: int, draft: int, layout: SlotLayout, timeout_s: float):
        self.source, self._group, self._draft, self._layout, self._timeout_s = source, group, draft, layout, timeout_s
        self._buf = host_buffer(layout)
        self._header, self._data = layout.views(self._buf)

    def post(self, slot: int, value: int, taps: list[torch.Tensor], tokens: int) -> None:
        self._layout.write(self._data, taps, tokens)
        self._header.copy_(torch.tensor([value, tokens]))
        what = f"source stage {self.source} sent {describe(value)}"
        work = start(lambda: dist.isend(self._buf, group=self._group, group_dst=self._draft), what)
        await_work(work, self._timeout_s, writer_timeout(self.source, slot, value, self._timeout_s), what)

    def fetch(self, slot: int, expected: int) -> torch.Tensor:
        what = f"the draft stage received {describe(expected)} from source stage {self.source}"
        work = start(lambda: dist.irecv(self._buf, group=self._group, group_src=self.source), what)
        await_work(work, self._timeout_s, reader_timeout(self.source, slot, expected, self._timeout_s), what)
        found, tokens = self._header.tolist()
        if found != expected:
            raise ordering_fault(self.source, slot, expected, found)
        return self._layout.read(self._data, tokens)

    def drain(self) -> None:
        """Nothing in flight: post() returns once its send completed."""

    def close(self) -> None:
        """The buffer is plain memory; the channel destroys the group."""
