"""`codraft train`: GRPO post-training with the draft co-trained in the same step."""

from __future__ import annotations

import logging
from collections import deque
from contextlib import nullcontext

from codraft.bench.e2e import run_speedup
from codraft.config import Config
from codraft.host_memory import step_end
from codraft.interrupt import StopOnSignal
from codraft.models import policy_args
from codraft.observability import MetricsLogger, progress
from codraft.parallel.collectives import anyone, prepare_run_dir, watch
from codraft.parallel.launch import launched, relaunch
from codraft.parallel.mesh import ParallelDims, parallel_dims
from codraft.train.resume import resumable_checkpoint
from codraft.train.trainer import Trainer

log = logging.getLogger(__name__)

SUMMARY = ("reward/mean", "reward/accuracy", "reward/final_answer_accuracy", "spec/acceptance_length",
           "rollout/tokens_per_s", "loss/draft", "time/step_s")
SPEEDUP = "rollout/speedup_measured"  # logged on the steps of rl.measure_speedup_every only
STEP_SPEEDUP = "step/speedup_measured"  # the same steps, pp = 1 (trainer.py: time/draft_train_s)
SUMMARY_STEPS = 5  # the summary compares the means of the first and the last this many steps


def main(cfg: Config) -> int:
    p = cfg.parallel
    if p.dp * p.pp * p.cp > 1 and not launched():
        policy_args(cfg)  # the rules that need the policy, before relaunch writes the run's config.yaml
        if cfg.checkpoint.resume is not None:
            resumable_checkpoint(cfg)  # refused here, before relaunch writes the run's config.yaml
        return relaunch(cfg, "train", p.dp * p.pp * p.cp)
    dims = parallel_dims(cfg)
    with watch(dims):  # a rank that stalls fails the others with one line naming it
        return train(cfg, dims)


def train(cfg: Config, dims: ParallelDims) -> int:
    """The steps from the checkpoint resumed (or 0) to rl.steps; the exit code (128 + a signal that stopped it)."""
    trainer = Trainer(cfg, None, dims)  # loads and checks every input
    run_dir = trainer.run_dir = prepare_run_dir(cfg, dims)  # only now: a refused run leaves nothing on disk
    writer = dims.is_writer  # global rank 0 alone writes metrics and checkpoints
    # the summary's first and last 5 steps: a run of any length keeps 10 rows, not one per step
    head: list[dict] = []
    tail: deque[dict] = deque(maxlen=SUMMARY_STEPS)
    speedups: dict[int, tuple[float, float]] = {}  # step -> (plain, speculative) rollout seconds, measured
    step_speedups: dict[int, tuple[float, float]] = {}  # step -> (without a draft, with it) step seconds
    resumed = trainer.step if cfg.checkpoint.resume is not None else None  # later rows are dropped
    logger = MetricsLogger(run_dir, cfg.run.tensorboard, resumed) if writer else nullcontext()
    with StopOnSignal() as stop, logger as metrics:
        bar = progress(range(trainer.step, cfg.rl.steps), desc="train")
        for _ in bar:
            # this rank's resident memory (the writer's, in the file); under release, the step's freed tensors
            # go back to the OS, timed outside time/step_s
            step_metrics = trainer.train_step() | step_end(cfg.run.host_memory)
            if writer:
                metrics.log(trainer.step, step_metrics)
            (head if len(head) < SUMMARY_STEPS else tail).append(step_metrics)
            if SPEEDUP in step_metrics:
                speedups[trainer.step] = (step_metrics["rollout/plain_s"], step_metrics["rollout/spec_s"])
            if STEP_SPEEDUP in step_metrics:
                step_speedups[trainer.step] = (step_metrics["step/plain_s"], step_metrics["time/step_s"])
            live = {"reward": step_metrics["reward/mean"], "tau": step_metrics["spec/acceptance_length"],
                    "step_s": step_metrics["time/step_s"]}
            bar.set_postfix({k: f"{v:.2f}" for k, v in live.items()})
            log.info("step %d/%d  %s", trainer.step, cfg.rl.steps, "  ".join(f"{k} {v:.3f}" for k, v in live.items()))
            if anyone(stop.signum is not None, dims):  # every rank stops after the same step
                break
            every = cfg.checkpoint.every
            if every and trainer.step % every == 0 and trainer.step < cfg.rl.steps:
                trainer.save()  # collective under PP: every rank hands over its stage's optimizer state
        trainer.save()  # the last completed step, interrupted or not
    log.info("summary (first -> last 5 steps mean):\n%s", summary_table(head, list(tail)))
    if speedups:
        log.info("%s", speedup_line(speedups, "speculative rollout vs plain decoding of the same prompts and row "
                                              "lengths", "plain seconds over speculative seconds"))
    if step_speedups:
        log.info("%s", speedup_line(step_speedups, "training step vs the same step without a draft (its rollout "
                                                   "decoded plainly, no draft training; each part timed in the step)",
                                    "seconds without a draft over the step's seconds"))
    if stop.signum is not None:
        log.info("stopped after step %d; continue with: codraft train --resume %s", trainer.step, run_dir)
    return stop.exit_code


def speedup_line(speedups: dict[int, tuple[float, float]], what: str, ratio: str) -> str:
    """A measured speedup of the run (`run_speedup`, as `codraft bench e2e` reports it) from each measured step's
    (seconds without speculation, seconds with it), and the steps' own ratios; `ratio` says what it divides."""
    run = run_speedup([plain for plain, _ in speedups.values()], [spec for _, spec in speedups.values()])
    steps = ", ".join(f"{step}: {plain / spec:.2f}x" for step, (plain, spec) in speedups.items())
    return (f"{what}, measured (rl.measure_speedup_every): {run.ratio:.2f}x ({ratio}) over {run.steps} steps, "
            f"per step mean SE {run.se:.2g}, median {run.median:.2f}x ({steps})")


def summary_table(head: list[dict], tail: list[dict]) -> str:
    """The SUMMARY metrics' means over the first steps (`head`) and the last (`tail`, or `head` if no more ran)."""
    if not head:
        return "(no steps run)"
    tail = (head + tail)[-SUMMARY_STEPS:]

    def mean(rows: list[dict], key: str) -> float:
        vals = [r[key] for r in rows if key in r and r[key] == r[key]]
        return sum(vals) / len(vals) if vals else float("nan")

    lines = [f"{'metric':<30}{'first 5':>10}{'last 5':>10}"]
    lines += [f"{k:<30}{mean(head, k):>10.3f}{mean(tail, k):>10.3f}" for k in SUMMARY]
    return "\n".join(lines)
