"""bench tapchannel: what carrying taps to the draft costs a pipeline-parallel training step.

For each (pp, microbatches, draft family) one gloo job on 127.0.0.1 times the same PP policy step (tiny preset,
a fixed rollout batch) with draft training disabled, then with the draft co-trained over TapChannel for each
transport. The incremental cost of TapChannel is the step time minus the no-draft step minus the draft's own
compute (its loss forward + backward over the same microbatches, timed alone on the last stage); the time spent
inside post() and fetch() is reported beside it. host_staging is not run: its blocking post deadlocks inside a
schedule (see `codraft.parallel.pipeline.StageModule`).
"""

from __future__ import annotations

import logging
import os
import pickle
import socket
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from codraft.bench.report import machine, markdown_table, median, write_results
from codraft.config import DraftConfig, RLConfig
from codraft.drafts import DraftBatch, build_draft
from codraft.models import load_model
from codraft.parallel.pipeline import StageModule, build_stage, run_pipeline, stage_state_dict, tap_sources
from codraft.parallel.tapchannel import TapChannel, TapSpec
from codraft.rl.microbatch import split_rollouts
from codraft.rl.pipeline_loss import JointObjective

log = logging.getLogger(__name__)

MODES = ("no_draft", "shm", "pg")


def _rollouts(n: int, prompt_len: int, completion_len: int):
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 250, (prompt_len,), generator=g).tolist() for _ in range(n)]
    completions = [torch.randint(3, 250, (completion_len,), generator=g).tolist() for _ in range(n)]
    logprobs = [(-torch.rand(completion_len, generator=g)).tolist() for _ in completions]
    return prompts, completions, logprobs, torch.randn(n, generator=g)


class _Timed:
    """Wraps TapChannel.post/fetch to add up the seconds spent inside them."""

    def __init__(self, channel: TapChannel):
        self.channel, self.seconds = channel, 0.0
        self.transports = channel.transports

    def _time(self, fn, *args):
        start = time.perf_counter()
        out = fn(*args)
        self.seconds += time.perf_counter() - start
        return out

    def post(self, m, taps):
        return self._time(self.channel.post, m, taps)

    def fetch(self, m):
        return self._time(self.channel.fetch, m)


def _run_mode(rank: int, pp: int, n_mb: int, family: str, mode: str, sequences: int, repeats: int) -> dict:
    policy, tokenizer = load_model("tiny-llama")
    torch.manual_seed(0)
    draft = build_draft(DraftConfig(family=family), policy, tokenizer)
    stage = build_stage(policy.args, rank, pp)
    stage.load_state_dict(stage_state_dict(policy.state_dict(), stage))
    last = rank == pp - 1
    draft.attach(stage)
    mbs, ids = split_rollouts(*_rollouts(sequences, 24, 40), n_microbatches=n_mb, pad_to=64)
    with_draft = mode != "no_draft"
    rl = RLConfig(draft_weight=0.1 if with_draft else 0.0)
    sources = tap_sources(draft.tap_layers, policy.args.num_layers, pp) if with_draft else {}
    channel = TapChannel(sources, TapSpec(ids.shape[1], policy.args.hidden_size, torch.float32),
                         n_microbatches=n_mb, transport=mode) if sources else None
    timed = _Timed(channel) if channel is not None else None
    module = StageModule(stage, rank, pp, draft.tap_layers if with_draft else (), timed,
                         draft if last and with_draft else None, JointObjective(rl, draft, mbs) if last else None)
    module.metas = [mb.meta for mb in mbs]
    steps = []
    for _ in range(repeats + 1):  # the first step warms up
        dist.barrier()
        start = time.perf_counter()
        run_pipeline(module, ids if rank == 0 else None, schedule="1F1B", group=None, device=torch.device("cpu"))
        dist.barrier()
        steps.append(time.perf_counter() - start)
        stage.zero_grad(set_to_none=True)
        if channel is not None:
            channel.reset()
    if channel is not None:
        channel.close()
    result = {"step_s": median(steps[1:]), "channel_s": timed.seconds / (repeats + 1) if timed else 0.0}
    if last and with_draft:
        result["draft_s"] = _draft_compute(stage, draft, mbs, ids, repeats)
    return result


def _draft_compute(stage, draft, mbs, ids, repeats: int) -> float:
    """Seconds of the draft's own loss forward + backward over the step's microbatches (taps from a local run)."""
    times = []
    for _ in range(repeats):
        total = 0.0
        for mb, row in zip(mbs, ids, strict=True):
            b = mb.batch
            with torch.no_grad():
                x = torch.randn(1, row.numel(), stage.args.hidden_size)
                out = stage(x, positions=mb.meta.positions, cu_seqlens=mb.meta.cu_seqlens)
            taps = {layer: torch.randn(mb.meta.tokens, stage.args.hidden_size) for layer in draft.tap_layers}
            logits = out.logits[0, : mb.meta.tokens]
            start = time.perf_counter()
            loss, _ = draft.loss(DraftBatch(b.input_ids, taps, logits, b.response_mask, b.cu_seqlens))
            loss.backward()
            total += time.perf_counter() - start
        draft.zero_grad(set_to_none=True)
        times.append(total)
    return median(times)


def _worker(rank: int, pp: int, port: int, n_mb: int, family: str, sequences: int, repeats: int, out: str):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=pp, timeout=timedelta(seconds=120))
    try:
        results = {mode: _run_mode(rank, pp, n_mb, family, mode, sequences, repeats) for mode in MODES}
        everyone: list = [None] * pp
        dist.all_gather_object(everyone, results)
        if rank == 0:
            Path(out).write_bytes(pickle.dumps(everyone))
    finally:
        dist.destroy_process_group()


def _job(pp: int, n_mb: int, family: str, sequences: int, repeats: int) -> list[dict]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.pkl")
        mp.spawn(_worker, args=(pp, port, n_mb, family, sequences, repeats, out), nprocs=pp, join=True)
        return pickle.loads(Path(out).read_bytes())


def _row(pp: int, n_mb: int, family: str, per_rank: list[dict]) -> list[dict]:
    """One row per transport: step times (slowest rank), the incremental cost and its breakdown."""
    base = max(r["no_draft"]["step_s"] for r in per_rank)
    draft_s = per_rank[-1]["shm"]["draft_s"]
    rows = []
    for mode in MODES[1:]:
        step = max(r[mode]["step_s"] for r in per_rank)
        rows.append({"pp": pp, "microbatches": n_mb, "family": family, "transport": mode, "no_draft_step_s": base,
                     "step_s": step, "draft_compute_s": draft_s, "incremental_s": step - base - draft_s,
                     "post_s": max(r[mode]["channel_s"] for r in per_rank[:-1]),
                     "fetch_s": per_rank[-1][mode]["channel_s"]})
    return rows


def run_tapchannel_bench(out_dir: str | Path = "results", pps: tuple[int, ...] = (2, 4),
                         microbatches: tuple[int, ...] = (4, 8), families: tuple[str, ...] = ("eagle3", "dflash",
                                                                                              "dspark"),
                         sequences: int = 16, repeats: int = 3) -> dict:
    rows = []
    for pp in pps:
        for n_mb in microbatches:
            for family in families:
                log.info("bench tapchannel: pp=%d microbatches=%d %s", pp, n_mb, family)
                rows += _row(pp, n_mb, family, _job(pp, n_mb, family, sequences, repeats))
    header = ["pp", "mb", "family", "transport", "no-draft step s", "step s", "draft compute s",
              "incremental s", "post s", "fetch s"]
    keys = ["pp", "microbatches", "family", "transport", "no_draft_step_s", "step_s", "draft_compute_s",
            "incremental_s", "post_s", "fetch_s"]
    table = markdown_table(header, [[r[k] for k in keys] for r in rows])
    payload = {"machine": machine(), "preset": "tiny-llama", "sequences": sequences, "repeats": repeats,
               "rows": rows}
    write_results(out_dir, "tapchannel", payload, table)
    _plot(rows, Path(out_dir) / "tapchannel.png")
    return payload


def _plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(6, len(rows) * 0.5), 4))
    labels = [f"pp{r['pp']} mb{r['microbatches']}\n{r['family']} {r['transport']}" for r in rows]
    parts = [("no_draft_step_s", "no-draft step"), ("draft_compute_s", "draft compute"),
             ("incremental_s", "TapChannel increment")]
    bottom = [0.0] * len(rows)
    for key, name in parts:
        values = [max(r[key], 0.0) for r in rows]
        ax.bar(range(len(rows)), values, bottom=bottom, label=name)
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    ax.set_xticks(range(len(rows)), labels, rotation=90, fontsize=6)
    ax.set_ylabel("seconds per step")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
