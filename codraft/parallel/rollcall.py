"""Naming the rank a timed-out wait was for.

Every wait on another rank is bounded by `parallel.timeout_s` (the process groups' timeout, TapChannel's), but gloo
says only "Timed out waiting 5000ms for recv operation to complete": not for whom. So a rank whose wait failed
calls the roll: on a gloo group of the whole job kept for this alone, it sends one message to every other rank and
waits (at most ROLL_CALL_S) for one from each. A rank whose own wait failed too calls the same roll and answers;
a frozen (SIGSTOP), dead or still-stalled rank does not, and is named in a one-line `RankTimeout`, with the wait
that failed (the collective or TapChannel wait, and the codraft function that waited).
"""

from __future__ import annotations

import logging
import time
import traceback
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

import codraft
from codraft.config import ConfigError
from codraft.parallel.tapchannel import TapChannelTimeout

log = logging.getLogger(__name__)

ROLL_CALL_S = 5.0  # the longest a rank waits for the others' answers after its own wait failed (or timeout_s / 2)
_TAG = 7  # the roll call's only message; its group carries nothing else
# what gloo says when a wait ran out or the peer went away
PEER_FAULTS = ("Timed out waiting", "Connection closed by peer", "Connection reset by peer")
_CODRAFT = str(Path(codraft.__file__).parent)
_TORCH_DISTRIBUTED = str(Path(dist.__file__).parent)


class RankTimeout(ConfigError):
    """A wait on other ranks ran out (or lost its peer): one line naming them; exit code 1, not a usage error."""

    exit_code = 1


def is_peer_fault(e: BaseException) -> bool:
    """A gloo wait that timed out or lost its peer (also inside a TapChannel error), or a TapChannel timeout."""
    return isinstance(e, TapChannelTimeout) or (isinstance(e, RuntimeError) and any(s in str(e) for s in PEER_FAULTS))


def failed_wait(e: BaseException) -> str:
    """The torch.distributed call that failed and the codraft functions that led to it (innermost first, up to
    three), from the traceback."""
    frames = traceback.extract_tb(e.__traceback__)
    op = next((f.name for f in reversed(frames) if f.filename.startswith(_TORCH_DISTRIBUTED)), "a wait")
    ours = [f for f in reversed(frames) if f.filename.startswith(_CODRAFT)][:3]
    if not ours:
        return f"torch.distributed {op}"
    where = Path(ours[0].filename).relative_to(Path(_CODRAFT).parent)
    return f"torch.distributed {op} from {' < '.join(f.name for f in ours)} ({where}:{ours[0].lineno})"


def _wait(work: dist.Work, deadline: float) -> bool:
    """Whether `work` completed before `deadline` (a peer that is gone or silent fails it)."""
    try:
        work.wait(timeout=timedelta(seconds=max(deadline - time.monotonic(), 0.01)))
        return True
    except RuntimeError:
        return False


class RollCall:
    """The roll call's gloo group over every rank of the job (collective to create, like any group)."""

    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s
        self.group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
        # the roll call's sends, awaited only until the deadline (a frozen peer never receives) and kept: gloo
        # drops a send whose work object is freed, and a rank that calls the roll later would hear nobody
        self._sent: list[dist.Work] = []

    def silent_ranks(self) -> list[int]:
        """The ranks that do not answer within ROLL_CALL_S (or timeout_s / 2, if shorter)."""
        me = dist.get_rank()
        peers = [r for r in range(dist.get_world_size()) if r != me]
        replies, answers = {}, []
        for p in peers:
            try:
                answers.append(dist.isend(torch.ones(1), dst=p, group=self.group, tag=_TAG))
                replies[p] = dist.irecv(torch.zeros(1), src=p, group=self.group, tag=_TAG)
            except RuntimeError:  # p is gone
                pass
        self._sent.extend(answers)
        deadline = time.monotonic() + min(ROLL_CALL_S, self.timeout_s / 2)
        silent = [p for p in peers if p not in replies]
        for p, work in replies.items():
            if not _wait(work, deadline):
                silent.append(p)
        # gloo hands a send over only once its peer has posted the receive: a rank that left right after hearing
        # everyone could take its own answer to a later caller with it, and be named silent by that caller
        for work in answers:
            _wait(work, deadline)
        return sorted(silent)

    def error(self, e: BaseException) -> RankTimeout:
        """The one-line error for the failed wait `e`, naming the ranks that did not answer the roll call."""
        me = dist.get_rank()
        log.debug("rank %d: the wait that failed: %s", me, e)
        if isinstance(e, TapChannelTimeout):
            head = f"rank {me}: {e}"
        elif "Timed out" in str(e):
            head = f"rank {me} waited parallel.timeout_s={self.timeout_s:g} s in {failed_wait(e)}"
        else:
            head = f"rank {me} lost a peer in {failed_wait(e)}"
        silent = self.silent_ranks()
        if silent:
            names = f"rank{'s' if len(silent) > 1 else ''} {', '.join(map(str, silent))}"
            who = f"{names} did not answer a roll call (frozen, stalled or dead)"
        else:
            who = "every rank answered a roll call afterwards"
        return RankTimeout(f"{head}; {who}")
