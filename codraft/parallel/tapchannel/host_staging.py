"""Baseline transport for comparison: one host staging slot and a blocking send inside post().

The taps are copied into the host buffer (pinned when they live on a GPU) and sent over the channel's gloo group;
post() returns only once that send has completed, i.e. once the draft stage has received the microbatch. There is
no ring: a source can be at most one microbatch ahead of the draft stage's fetches, and waits for the last stage
at every microbatch after the first.

The draft stage keeps its one receive posted ahead (the slot of the next microbatch), as the pg transport does.
Without that, a source's post inside its forward would wait for a fetch that waits for the very activations the
source sends only after its forward returns: a deadlock under any pipeline schedule.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from codraft.parallel.tapchannel.pg import PgLink, await_work
from codraft.parallel.tapchannel.protocol import SlotLayout, TapChannelTimeout, describe


class HostStagingLink(PgLink):
    """A PgLink of depth 1 whose post blocks until the send completed."""

    def __init__(self, group: dist.ProcessGroup, source: int, draft: int, layout: SlotLayout, timeout_s: float,
                 is_writer: bool):
        super().__init__(group, source, draft, layout, 1, timeout_s, is_writer)

    def post(self, slot: int, value: int, taps: list[torch.Tensor], tokens: int) -> None:
        super().post(slot, value, taps, tokens)
        what = f"source stage {self.source} waited for the draft stage to receive {describe(value)}"
        timed_out = TapChannelTimeout(f"TapChannel timeout: source stage {self.source} waited {self._timeout_s:g} s "
                                      f"for the draft stage to receive {describe(value)} (host staging blocks "
                                      "until then); is the draft stage dead or stalled?")
        await_work(self._work[slot], self._timeout_s, timed_out, what)
        self._work[slot] = None
