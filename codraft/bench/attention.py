"""Attention benchmark: the draft's training attention under CP, zigzag ring vs USP vs the single-device op.

Workloads (one draft layer's attention, forward and backward):
  ttt     EAGLE-3 with `ttt_passes` TTT passes: pass 0 is causal attention of the main tokens, pass k >= 1
          one branch per token (queries only) over the pass-0 keys plus k branch-local keys.
  dflash  DFlash blocks: `anchors_per_seq` blocks of `block` queries per sequence, exclusive anchors,
          the block's own keys bidirectional.
For each CP degree and total sequence length (a few packed sequences of unequal lengths) it measures
forward and backward latency (median of `iters` after a warm-up, the slowest rank) and the per-rank
peak memory of one forward + backward (`codraft.bench.memory`: live tensor bytes on CPU, the allocator's
peak on CUDA; the largest rank). cp = 1 is the single-device fused op; cp > 1 runs the zigzag ring and
USP with the largest Ulysses degree that divides cp and both head counts. Ranks are processes on
127.0.0.1 (gloo), one compute thread each.

Writes <out_dir>/attention.json, attention.md and attention.png.
"""

from __future__ import annotations

import json
import logging
import math
import os
import socket
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from codraft.attention import Branches, branch_attention
from codraft.bench.memory import peak_memory
from codraft.bench.report import machine
from codraft.parallel.cp_shard import zigzag_layout
from codraft.parallel.mesh import ParallelDims
from codraft.parallel.ring_attention import ring_branch_attention
from codraft.parallel.usp_attention import usp_branch_attention

log = logging.getLogger(__name__)

SEQ_FRACTIONS = (0.4, 0.3, 0.2, 0.1)  # the packed batch: four sequences of unequal lengths


@dataclass
class AttentionBenchShape:
    heads: int = 8
    kv_heads: int = 2
    head_dim: int = 64
    ttt_passes: int = 3
    block: int = 16
    anchors_per_seq: int = 8
    dtype: str = "float32"


# (q, k, v, cu_seqlens, branches) -> AttentionOutput
Attention = Callable[..., object]


def _lengths(total: int) -> list[int]:
    lens = [int(total * f) for f in SEQ_FRACTIONS]
    lens[0] += total - sum(lens)
    return lens


def _cu(lens: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])


def _dflash_anchors(lens: list[int], shape: AttentionBenchShape) -> torch.Tensor:
    """Evenly spread anchors whose block stays inside its sequence (never at its last block - 1 tokens)."""
    cu = _cu(lens).tolist()
    anchors = []
    for start, n in zip(cu[:-1], lens, strict=True):
        room = n - shape.block
        anchors += [start + 1 + room * i // shape.anchors_per_seq for i in range(shape.anchors_per_seq)]
    return torch.tensor(anchors)


class Workload:
    """One workload's global tensors (identical on every rank) and its forward on a rank's shard."""

    def __init__(self, kind: str, lens: list[int], shape: AttentionBenchShape, cp: int, rank: int):
        self.kind, self.shape = kind, shape
        self.cu = _cu(lens)
        self.layout = zigzag_layout(self.cu, cp, rank)
        T, H, Hkv, D = sum(lens), shape.heads, shape.kv_heads, shape.head_dim
        dtype = getattr(torch, shape.dtype)
        g = torch.Generator().manual_seed(0)

        def randn(*size):
            return torch.randn(*size, generator=g).to(dtype)

        def local(x):  # per-token tensor -> this rank's tokens (the whole batch when cp == 1)
            return x if cp == 1 else self.layout.shard(x)

        self.k, self.v = local(randn(T, Hkv, D)), local(randn(T, Hkv, D))
        self.local_cu = self.cu if cp == 1 else self.layout.cu_seqlens
        n = self.k.shape[0]
        if kind == "ttt":
            self.q = [local(randn(T, H, D)) for _ in range(shape.ttt_passes)]  # pass 0: main queries
            self.pass_k = [local(randn(T, Hkv, D)) for _ in range(shape.ttt_passes - 1)]
            self.pass_v = [local(randn(T, Hkv, D)) for _ in range(shape.ttt_passes - 1)]
            self.anchors = torch.arange(n)
        else:
            anchors = _dflash_anchors(lens, shape)
            owned, self.anchors = (torch.arange(len(anchors)), anchors) if cp == 1 else self.layout.route(anchors)
            b = shape.block
            self.q = [randn(len(anchors), b, H, D)[owned]]
            self.pass_k, self.pass_v = [randn(len(anchors), b, Hkv, D)[owned]], [randn(len(anchors), b, Hkv, D)[owned]]
        for t in self.leaves():
            t.requires_grad_()

    def leaves(self) -> list[torch.Tensor]:
        return [self.k, self.v, *self.q, *self.pass_k, *self.pass_v]

    def forward(self, attention: Attention) -> torch.Tensor:
        """One draft layer's attention for every pass; returns a scalar to backpropagate."""
        if self.kind == "dflash":
            b = Branches(self.q[0], self.pass_k[0], self.pass_v[0], self.anchors, inclusive=False)
            return attention(None, self.k, self.v, self.local_cu, b).branch_out.float().square().mean()
        loss = attention(self.q[0], self.k, self.v, self.local_cu, None).out.float().square().mean()
        for p in range(1, self.shape.ttt_passes):
            local_k = torch.stack(self.pass_k[:p], dim=1)  # [T, p, Hkv, D]: keys of passes 1..p at each position
            local_v = torch.stack(self.pass_v[:p], dim=1)
            b = Branches(self.q[p][:, None], local_k, local_v, self.anchors, inclusive=True)
            loss = loss + attention(None, self.k, self.v, self.local_cu, b).branch_out.float().square().mean()
        return loss


def _ulysses_degree(cp: int, shape: AttentionBenchShape) -> int:
    return math.gcd(cp, shape.heads, shape.kv_heads)


def _measure(work: Workload, attention: Attention, iters: int, group) -> dict:
    """Median forward/backward seconds of the slowest rank, and the largest per-rank peak bytes."""
    fwd, bwd = [], []
    for i in range(iters + 1):  # the first is a warm-up
        if group is not None:
            dist.barrier(group=group)
        t0 = time.perf_counter()
        loss = work.forward(attention)
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        if i:
            fwd.append(t1 - t0)
            bwd.append(t2 - t1)
    for t in work.leaves():
        t.grad = None
    with peak_memory(work.k.device) as mem:
        work.forward(attention).backward()
    stats = torch.tensor([statistics.median(fwd), statistics.median(bwd), float(mem.bytes)], dtype=torch.float64)
    if group is not None:
        dist.all_reduce(stats, op=dist.ReduceOp.MAX, group=group)
    return {"fwd_ms": 1e3 * stats[0].item(), "bwd_ms": 1e3 * stats[1].item(), "peak_mib": stats[2].item() / 2**20}


def _points(cp: int, seq_lens, workloads, shape: AttentionBenchShape, iters: int) -> list[dict]:
    """Every (workload, length, impl) point of one CP degree; collective over the world when cp > 1."""
    rank = dist.get_rank() if cp > 1 else 0
    impls: dict[str, tuple[str, Attention]] = {}
    group = None
    if cp == 1:
        impls["single"] = ("1x1", lambda *a: branch_attention(*a, impl="fused"))
    else:
        dims = ParallelDims(1, 1, cp, cp).build()
        group = dims.cp_group
        u = _ulysses_degree(cp, shape)
        ulysses, ring = dims.usp_groups(u)
        impls["ring"] = (f"1x{cp}", lambda *a: ring_branch_attention(*a, group))
        impls["usp"] = (f"{u}x{cp // u}", lambda *a: usp_branch_attention(*a, ulysses, ring))
    rows = []
    for kind in workloads:
        for total in seq_lens:
            work = Workload(kind, _lengths(total), shape, cp, rank)
            for impl, (split, attention) in impls.items():
                row = {"workload": kind, "impl": impl, "cp": cp, "ulysses_x_ring": split, "seq_len": total}
                row |= _measure(work, attention, iters, group)
                rows.append(row)
                if rank == 0:
                    log.info("%s", row)
    return rows


def _worker(rank: int, cp: int, port: int, args: tuple, out_file: str, timeout_s: float) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)  # one compute thread per rank
    dist.init_process_group("gloo", rank=rank, world_size=cp, timeout=timedelta(seconds=timeout_s))
    try:
        rows = _points(cp, *args)
        if rank == 0:
            Path(out_file).write_text(json.dumps(rows))
    finally:
        dist.destroy_process_group()


def _run_cp(cp: int, args: tuple, timeout_s: float) -> list[dict]:
    if cp == 1:
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            return _points(1, *args)
        finally:
            torch.set_num_threads(threads)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out_file = os.path.join(tmp, "rows.json")
        mp.spawn(_worker, args=(cp, port, args, out_file, timeout_s), nprocs=cp, join=True)  # a failed rank raises
        return json.loads(Path(out_file).read_text())


def run_attention_bench(
    out_dir: str | Path = "results",
    cps: tuple[int, ...] = (1, 2, 4),
    seq_lens: tuple[int, ...] = (1024, 2048, 4096),
    workloads: tuple[str, ...] = ("ttt", "dflash"),
    shape: AttentionBenchShape | None = None,
    iters: int = 2,
    timeout_s: float = 300.0,
) -> list[dict]:
    """Run the benchmark and write attention.json / .md / .png under out_dir; returns the rows."""
    shape = shape or AttentionBenchShape()
    for kind in workloads:
        if kind not in ("ttt", "dflash"):
            raise ValueError(f"workloads must be drawn from ('ttt', 'dflash'); got {kind!r}")
    min_len = max(2 * max(cps), shape.block + shape.anchors_per_seq + 1)
    if min(seq_lens) * min(SEQ_FRACTIONS) < min_len:
        raise ValueError(f"seq_lens must be >= {math.ceil(min_len / min(SEQ_FRACTIONS))}; got {list(seq_lens)}")
    rows = []
    for cp in cps:
        log.info("attention bench: cp=%d", cp)
        rows += _run_cp(cp, (seq_lens, workloads, shape, iters), timeout_s)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    payload = {"machine": machine(), "shape": asdict(shape), "rows": rows}
    (out / "attention.json").write_text(json.dumps(payload, indent=1))
    (out / "attention.md").write_text(markdown_table(rows, shape))
    plot(rows, out / "attention.png")
    return rows


def markdown_table(rows: list[dict], shape: AttentionBenchShape) -> str:
    head = (
        f"Draft attention, forward + backward per layer: H={shape.heads}, Hkv={shape.kv_heads}, "
        f"D={shape.head_dim}, {shape.dtype}; TTT {shape.ttt_passes} passes; DFlash {shape.anchors_per_seq} "
        f"blocks of {shape.block} per sequence; {len(SEQ_FRACTIONS)} packed sequences. Latency: slowest rank; "
        "memory: largest per-rank peak.\n\n"
        "| workload | impl | cp | ulysses x ring | total seq len | fwd ms | bwd ms | peak MiB / rank |\n"
        "|---|---|---|---|---|---|---|---|\n"
    )
    lines = [
        f"| {r['workload']} | {r['impl']} | {r['cp']} | {r['ulysses_x_ring']} | {r['seq_len']} | "
        f"{r['fwd_ms']:.1f} | {r['bwd_ms']:.1f} | {r['peak_mib']:.1f} |"
        for r in sorted(rows, key=lambda r: (r["workload"], r["seq_len"], r["cp"], r["impl"]))
    ]
    return head + "\n".join(lines) + "\n"


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = sorted({r["workload"] for r in rows})
    fig, axes = plt.subplots(len(workloads), 2, figsize=(11, 4 * len(workloads)), squeeze=False)
    for row_axes, kind in zip(axes, workloads, strict=True):
        series = sorted({(r["impl"], r["cp"]) for r in rows if r["workload"] == kind}, key=lambda s: (s[1], s[0]))
        for impl, cp in series:
            pts = sorted(
                (r for r in rows if (r["workload"], r["impl"], r["cp"]) == (kind, impl, cp)), key=lambda r: r["seq_len"]
            )
            x = [r["seq_len"] for r in pts]
            label = f"{impl} cp={cp}"
            row_axes[0].plot(x, [r["fwd_ms"] + r["bwd_ms"] for r in pts], marker="o", label=label)
            row_axes[1].plot(x, [r["peak_mib"] for r in pts], marker="o", label=label)
        for ax, ylabel in zip(row_axes, ("fwd + bwd ms (slowest rank)", "peak MiB per rank"), strict=True):
            ax.set_title(kind)
            ax.set_xlabel("total sequence length")
            ax.set_ylabel(ylabel)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
