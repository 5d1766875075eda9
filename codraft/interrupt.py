"""SIGINT / SIGTERM during a loop of steps: the first lets the current step finish, a second abandons it."""

from __future__ import annotations

import logging
import signal
import threading
from types import FrameType

log = logging.getLogger(__name__)

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Abandoned(KeyboardInterrupt):
    """A second signal: the step in flight is given up; `exit_code` is the shell's 128 + signal number."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.exit_code = 128 + signum


class StopOnSignal:
    """While active, SIGINT and SIGTERM only set `signum`, which the loop reads between steps; a second one raises
    `Abandoned` wherever the process is. Off the main thread (where Python cannot take signals) it does nothing."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self._previous: dict[int, object] = {}

    @property
    def exit_code(self) -> int:
        """0, or 128 + the signal number (130 for SIGINT, 143 for SIGTERM), as a shell reports a signalled run."""
        return 0 if self.signum is None else 128 + self.signum

    def __enter__(self) -> StopOnSignal:
        if threading.current_thread() is threading.main_thread():
            self._previous = {s: signal.signal(s, self._handle) for s in SIGNALS}
        return self

    def __exit__(self, *exc: object) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.signum is not None:
            raise Abandoned(signum)
        self.signum = signum
        log.warning("%s: finishing the current step, then a checkpoint and the summary (again to stop at once)",
                    signal.Signals(signum).name)
