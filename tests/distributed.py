"""The one way tests start multi-process torch.distributed jobs: gloo on 127.0.0.1.

`run_workers(fn, world_size, *args)` spawns `world_size` processes, each running
`fn(rank, world_size, *args)` inside an initialised gloo process group on a free
local port, and returns their results in rank order. A worker's exception is
re-raised here with its traceback; a job that outlives `timeout` is killed
(no leftover processes) and fails the test.
"""

from __future__ import annotations

import os
import queue
import socket
import traceback
from collections.abc import Callable, Collection
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, fn: Callable, args: tuple, results: mp.Queue, pg_timeout: float):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world_size), RANK=str(rank),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size), OMP_NUM_THREADS="1")
    try:
        torch.set_num_threads(1)  # the env var comes too late for torch's pool; ranks share the cores
        dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=pg_timeout))
        out = fn(rank, world_size, *args)
        results.put((rank, True, out))
    except BaseException:  # noqa: BLE001 - every failure must reach the parent
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_workers(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 120.0,
                pg_timeout: float = 30.0, awaited: Collection[int] | None = None) -> list[Any]:
    """Run fn(rank, world_size, *args) on `world_size` gloo ranks; fn must be importable (top-level). Only the
    results of the `awaited` ranks (default: all) are waited for and returned; once they are in, the other ranks
    are SIGKILLed, which also ends a rank the test froze with SIGSTOP."""
    awaited = range(world_size) if awaited is None else sorted(awaited)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, world_size, port, fn, args, results, pg_timeout), daemon=True)
             for r in range(world_size)]
    for p in procs:
        p.start()
    outcomes: dict[int, Any] = {}
    errors: list[str] = []
    try:
        while any(r not in outcomes for r in awaited):
            try:
                rank, ok, value = results.get(timeout=timeout)
            except queue.Empty:
                raise TimeoutError(f"distributed test did not finish within {timeout}s") from None
            if ok:
                outcomes[rank] = value
            else:
                errors.append(f"rank {rank}:\n{value}")
                break  # one failure is enough; the others may be stuck waiting for it
    finally:
        for rank, p in enumerate(procs):
            if rank not in awaited:
                p.kill()
            p.join(timeout=5 if not errors else 1)
            if p.is_alive():
                p.kill()
                p.join()
    if errors:
        raise RuntimeError("distributed worker failed\n" + "\n".join(errors))
    return [outcomes[r] for r in awaited]
