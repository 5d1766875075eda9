"""Starting a multi-process run for the user: `codraft train parallel.cp=N` outside torchrun re-runs
itself under torchrun on N local processes (127.0.0.1), from the resolved config."""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys

from codraft.interrupt import SIGNALS
from codraft.observability import prepare_run_dir

log = logging.getLogger(__name__)


def launched() -> bool:
    """True inside a torchrun (or any torch.distributed env://) process."""
    return "WORLD_SIZE" in os.environ


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def relaunch(cfg, command: str, nproc: int) -> int:
    """Run `codraft <command>` on `nproc` local processes with torchrun (torchrun.py: its failures in one line);
    returns its exit code. The run directory and its config.yaml are made here, so every process reads the same
    resolved config."""
    run_dir = prepare_run_dir(cfg, command)
    debug = ["--debug"] if cfg.run.log_level == "debug" else []
    argv = [
        sys.executable, "-m", "codraft.parallel.torchrun", *debug, "--nnodes", "1", "--nproc-per-node", str(nproc),
        "--master-addr", "127.0.0.1", "--master-port", str(_free_port()),
        "-m", "codraft", command, "--config", str(run_dir / "config.yaml"),
    ]  # fmt: skip
    log.info("launching %d processes: %s", nproc, " ".join(argv))
    # torchrun in a session of its own: a Ctrl-C in the terminal reaches it once, forwarded from here, and it
    # hands it to the workers, which finish their step, checkpoint it and exit
    with subprocess.Popen(argv, start_new_session=True) as proc:
        return _wait_forwarding_signals(proc)


def _wait_forwarding_signals(proc: subprocess.Popen) -> int:
    """proc's exit code, or 128 + the first SIGINT/SIGTERM this process received (each forwarded to proc)."""
    received: list[int] = []

    def forward(signum: int, frame: object) -> None:
        received.append(signum)
        proc.send_signal(signum)

    previous = {s: signal.signal(s, forward) for s in SIGNALS}
    try:
        code = proc.wait()
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    return 128 + received[0] if received else code
