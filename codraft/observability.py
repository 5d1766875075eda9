"""Logging, the run directory, per-step metrics (metrics.jsonl + TensorBoard) and progress bars."""

from __future__ import annotations

import json
import logging
import math
import os
import sys
import time
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from tqdm import tqdm

from codraft.config import save_config

log = logging.getLogger(__name__)


class _TqdmHandler(logging.StreamHandler):
    """Writes through ``tqdm.write`` so a log line does not tear an active progress bar."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            tqdm.write(self.format(record), file=self.stream)
        except Exception:
            self.handleError(record)


def rank() -> int | None:
    """This process's global rank under torchrun (or any env:// launch), None outside one."""
    return int(os.environ["RANK"]) if "RANK" in os.environ else None


def setup_logging(level: str = "info") -> None:
    """Log codraft at ``level`` to stderr; other libraries stay at warning. Safe to call again.

    Under torchrun the run speaks with one voice: rank 0 logs at ``level``, every other rank only its warnings
    and errors, and every line names its rank."""
    root = logging.getLogger()
    for handler in [h for h in root.handlers if isinstance(h, _TqdmHandler)]:
        root.removeHandler(handler)
    handler = _TqdmHandler(sys.stderr)
    where = "" if rank() is None else f"[rank {rank()}] "
    handler.setFormatter(logging.Formatter(f"%(asctime)s %(levelname)s {where}%(name)s: %(message)s", "%H:%M:%S"))
    root.addHandler(handler)
    root.setLevel(logging.WARNING)
    ours = logging.getLevelName(level.upper())
    logging.getLogger("codraft").setLevel(ours if not rank() else max(ours, logging.WARNING))


PROGRESS_LOG_EVERY_S = 60.0  # without a terminal, a bar's state becomes a log line at most this often


class _ProgressLines:
    """A file for tqdm that logs each new state of a bar as one INFO line (a log has no carriage return)."""

    def __init__(self) -> None:
        self.last = ""

    def write(self, text: str) -> None:
        text = text.strip()
        if text and text != self.last:  # closing repeats the final state
            self.last = text
            log.info("%s", text)

    def flush(self) -> None:
        pass


class _LoggedBar(tqdm):
    """A bar whose postfix waits for its next timed refresh: set every step, it must not log every step."""

    def set_postfix(self, ordered_dict=None, refresh=True, **kwargs):
        super().set_postfix(ordered_dict, refresh=False, **kwargs)


def progress(iterable_or_total: Iterable[Any] | int, desc: str = "", *, force: bool = False, **kwargs: Any) -> tqdm:
    """A tqdm bar on stderr when it is a terminal (or ``force``). Otherwise (CI, nohup, a batch job) a bar that
    has run `PROGRESS_LOG_EVERY_S` logs its state as a line that often, so a long phase is not silent and a
    short one adds nothing. Off on every torchrun rank but 0."""
    bar = tqdm
    if (force or sys.stderr.isatty()) and not rank():
        kwargs.update(file=sys.stderr, dynamic_ncols=True)
    else:
        bar = _LoggedBar
        every = PROGRESS_LOG_EVERY_S
        kwargs.update(file=_ProgressLines(), mininterval=every, delay=every, disable=bool(rank()),
                      bar_format="{desc}: {percentage:3.0f}% {n_fmt}/{total_fmt} [{elapsed}<{remaining}]{postfix}")
    kwargs["desc"] = desc
    if isinstance(iterable_or_total, int):
        return bar(total=iterable_or_total, **kwargs)
    return bar(iterable_or_total, **kwargs)


@contextmanager
def timed(seconds: dict[str, float], key: str) -> Iterator[None]:
    """Add the wall-clock seconds of the block to seconds[key]."""
    start = time.perf_counter()
    try:
        yield
    finally:
        seconds[key] += time.perf_counter() - start


def prepare_run_dir(cfg: Any, command: str) -> Path:
    """Create the run directory (``runs/<command>-<timestamp>`` unless ``run.dir`` is set) and save
    the resolved config there as ``config.yaml``."""
    if cfg.run.dir is None:
        base = f"runs/{command}-{time.strftime('%Y%m%d-%H%M%S')}"
        cfg.run.dir, n = base, 1
        while Path(cfg.run.dir).exists():  # two runs started in the same second
            cfg.run.dir, n = f"{base}-{n}", n + 1
    run_dir = Path(cfg.run.dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    save_config(cfg, run_dir / "config.yaml")
    log.info("run dir: %s", run_dir)
    return run_dir


class MetricsLogger:
    """One JSON object per step in ``<run_dir>/metrics.jsonl`` (``step`` first), mirrored to TensorBoard.

    Non-finite values are written as null and counted in ``non_finite`` (warned once per name). A run that
    resumes from the checkpoint of ``resume_step`` first drops the rows of later steps (written before an
    interruption; replaced atomically), and TensorBoard purges their events: every step is logged once.
    """

    def __init__(self, run_dir: str | Path, tensorboard: bool = True, resume_step: int | None = None) -> None:
        self.path = Path(run_dir) / "metrics.jsonl"
        if resume_step is not None:
            _drop_rows_after(self.path, resume_step)
        self._file = self.path.open("a", encoding="utf-8")
        self.non_finite: Counter[str] = Counter()
        purge = None if resume_step is None else resume_step + 1
        self._writer = _open_tensorboard(Path(run_dir), purge) if tensorboard else None

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        assert "step" not in metrics, "pass the step as the step argument"
        row: dict[str, float | None] = {"step": step}
        for name, value in metrics.items():
            value = float(value)
            if not math.isfinite(value):
                if not self.non_finite[name]:
                    log.warning(
                        "metric %s is %s at step %d; written as null (counted, not warned again)", name, value, step
                    )
                self.non_finite[name] += 1
                row[name] = None
                continue
            row[name] = value
            if self._writer is not None:
                self._writer.add_scalar(name, value, step)
        self._file.write(json.dumps(row, allow_nan=False) + "\n")
        self._file.flush()  # a crashed run keeps every step it logged

    def close(self) -> None:
        if self._file.closed:
            return
        self._file.close()
        if self._writer is not None:
            self._writer.close()
        if self.non_finite:
            log.warning(
                "%d non-finite metric values written as null: %s", sum(self.non_finite.values()), dict(self.non_finite)
            )

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _drop_rows_after(path: Path, step: int) -> None:
    """Rewrite the JSONL ``path`` without its rows after ``step`` (and a row torn by a kill mid-write)."""
    if not path.is_file():
        return
    kept, dropped = [], 0
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            row_step = json.loads(line)["step"]
        except (ValueError, KeyError, TypeError):
            row_step = None
        if isinstance(row_step, int) and row_step <= step:
            kept.append(line + "\n")
        else:
            dropped += 1
    if dropped:
        tmp = path.with_name(f".{path.name}.tmp")
        with tmp.open("w", encoding="utf-8") as f:
            f.writelines(kept)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        log.info("%s: dropped %d rows after step %d, the step this run resumes from", path, dropped, step)


def _open_tensorboard(run_dir: Path, purge_step: int | None = None) -> Any:
    try:
        from torch.utils.tensorboard import SummaryWriter  # lazy: pulls in torch and tensorboard
    except ImportError as e:
        log.warning("TensorBoard unavailable (%s); metrics go to metrics.jsonl only", e)
        return None
    return SummaryWriter(log_dir=str(run_dir), flush_secs=10, purge_step=purge_step)
