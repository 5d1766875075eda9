"""torchrun for codraft's relaunch (launch.py), with its failures said in one line.

Each rank says its own error (one `codraft: error: ...` line, cli.py). torchrun itself would add the traceback of
its ChildFailedError and a table of every rank when one fails, the traceback of its SignalException when it hands
on a Ctrl-C, and its warnings about stopping the others. Here torch.distributed.run runs in this process with
those caught and its logging quiet (unless --debug): the exit code is that of the first rank that failed on its
own (1 for a rank that timed out waiting, 2 for a user error); if every failed rank was killed by a signal,
128 + the first one's, said in one line (those ranks could say nothing); for a signal this process received and
handed on to the ranks, 128 + that signal.

    python -m codraft.parallel.torchrun [--debug] <torchrun arguments>
"""

from __future__ import annotations

import logging
import signal
import sys

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import parse_args, run


def quiet_torch_elastic() -> None:
    """torch.distributed's launcher loggers (each sets its own level, so each is set) to errors raised, not logged."""
    for name, logger in logging.root.manager.loggerDict.items():
        if name.startswith("torch.distributed") and isinstance(logger, logging.Logger):
            logger.setLevel(logging.CRITICAL)


def first_failure(e: ChildFailedError) -> tuple[int, str | None]:
    """(exit code, the line to print or None): the first rank that exited on its own (it said why, and a rank
    torchrun killed afterwards, e.g. a frozen one, adds nothing), else the first killed by a signal."""
    by_time = sorted(e.failures.items(), key=lambda kv: (kv[1].timestamp, kv[0]))
    for _, failure in by_time:
        if failure.exitcode >= 0:
            return failure.exitcode, None
    rank, failure = by_time[0]
    sig = signal.Signals(-failure.exitcode)
    return 128 + sig.value, f"codraft: error: rank {rank} was killed by {sig.name}; the other ranks were stopped"


def main(argv: list[str]) -> int:
    debug = argv[:1] == ["--debug"]
    args = parse_args(argv[1:] if debug else argv)
    if not debug:
        quiet_torch_elastic()
    try:
        run(args)
    except ChildFailedError as e:
        code, line = first_failure(e)
        if line is not None:
            print(line, file=sys.stderr)
        return code
    except SignalException as e:  # already handed on to the ranks, which checkpoint and say so
        return 128 + int(e.sigval)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
