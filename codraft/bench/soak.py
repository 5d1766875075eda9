"""`codraft bench soak`: a long run that is killed once and resumed, against the same run uninterrupted.

Both runs are `codraft train` subprocesses from the same resolved config (speculation on, rl.adaptive=false so
that timing changes no decision, checkpoint.every from the config):
  interrupted    SIGKILLed two steps after the first checkpoint at or past the midpoint, then `--resume`d to the end
  uninterrupted  the same steps in one process
Reported: the resident memory of the training process after step `checkpoint.every` and after the last step
(`memory/rss_mib`, which `codraft train` measures after each step: the high-water mark under the default
run.host_memory=keep, what is in use under release; the uninterrupted run is one process throughout: its
growth is the figure), that metrics.jsonl holds every step
exactly once, and that every step's metrics (timing and memory aside) equal the uninterrupted run's.
"""

from __future__ import annotations

import copy
import json
import logging
import shutil
import signal
import subprocess
import sys
from pathlib import Path

from codraft.bench.report import machine, markdown_table, write_results
from codraft.config import Config, ConfigError, save_config

log = logging.getLogger(__name__)

MACHINE = ("time/", "rollout/", "step/", "memory/")  # metrics that measure the machine, not the run
RSS = "memory/rss_mib"


def kill_step(steps: int, every: int) -> int:
    """Two steps past the first checkpoint at or past the midpoint: the resume redoes and must not repeat them."""
    first = -(-(steps // 2) // every) * every
    return first + 2


def train(argv: list[str], log_path: Path, kill_at: int | None = None) -> tuple[int, list[int]]:
    """Run `codraft train <argv>`, its stderr to log_path; SIGKILL it once it logs step `kill_at`. Returns the exit
    code and the steps it logged."""
    logged: list[int] = []
    with log_path.open("a") as out, subprocess.Popen([sys.executable, "-m", "codraft", "train", *argv],
                                                     stderr=subprocess.PIPE, text=True) as proc:
        for line in proc.stderr:
            out.write(line)
            if "codraft.commands.train: step " in line:
                step = int(line.split("codraft.commands.train: step ")[1].split("/")[0])
                logged.append(step)
                if step == kill_at:
                    proc.send_signal(signal.SIGKILL)
        return proc.wait(), logged


def metrics_rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def deterministic(row: dict) -> dict:
    return {k: v for k, v in row.items() if not k.startswith(MACHINE)}


def rss_per_step(rows: list[dict]) -> dict[int, float | None]:
    return {r["step"]: r.get(RSS) for r in rows}


def growth(rss: dict[int, float | None], first: int, last: int) -> float | None:
    a, b = rss.get(first), rss.get(last)
    return None if a is None or b is None else (b - a) / a


def run_soak_bench(cfg: Config, out_dir: str, runs_dir: str | Path) -> dict:
    """The soak of bench.soak_steps steps; each run trains in <runs_dir>/<run> (cleared first)."""
    steps, every = cfg.bench.soak_steps, cfg.checkpoint.every
    if cfg.draft.family == "none" or cfg.rl.num_speculative_tokens < 1:
        raise ConfigError("bench soak runs with speculation on: draft.family must be eagle3, dflash or dspark and "
                          f"rl.num_speculative_tokens >= 1 (got {cfg.draft.family}, {cfg.rl.num_speculative_tokens})")
    if every < 1:
        raise ConfigError("bench soak resumes from a checkpoint: checkpoint.every must be >= 1 (got 0)")
    kill_at = kill_step(steps, every)
    if kill_at >= steps:
        raise ConfigError(f"bench soak kills the run after step {kill_at} (two past the first checkpoint at or past "
                          f"the midpoint, checkpoint.every={every}): bench.soak_steps={steps} must be larger")
    runs = Path(runs_dir)
    dirs = {name: runs / name for name in ("interrupted", "uninterrupted")}
    logged, codes = {}, {}
    for name, run_dir in dirs.items():
        if run_dir.exists():
            log.info("soak: clearing %s from an earlier soak", run_dir)
            shutil.rmtree(run_dir)
        run_dir.mkdir(parents=True)
        run_cfg = copy.deepcopy(cfg)
        run_cfg.run.dir, run_cfg.rl.steps, run_cfg.rl.adaptive = str(run_dir), steps, False
        run_cfg.run.log_level = "info"  # its step lines are what this bench reads
        save_config(run_cfg, runs / f"{name}.yaml")
        log.info("soak: %s run of %d steps in %s", name, steps, run_dir)
        logfile = runs / f"{name}.log"
        logfile.unlink(missing_ok=True)
        if name == "interrupted":
            codes["killed"], logged["killed"] = train(["--config", str(runs / f"{name}.yaml")], logfile, kill_at)
            codes["resumed"], logged["resumed"] = train(["--resume", str(run_dir)], logfile)
        else:
            codes[name], logged[name] = train(["--config", str(runs / f"{name}.yaml")], logfile)
    if codes != {"killed": -signal.SIGKILL, "resumed": 0, "uninterrupted": 0}:
        raise RuntimeError(f"soak: a training run failed (exit codes {codes}); see the logs in {runs}")
    rows = {name: metrics_rows(d) for name, d in dirs.items()}
    differing = [a["step"] for a, b in zip(rows["interrupted"], rows["uninterrupted"], strict=False)
                 if deterministic(a) != deterministic(b)]
    resumed_from = min(logged["resumed"]) - 1
    rss = {name: rss_per_step(rs) for name, rs in rows.items()}  # interrupted: the killed process up to resumed_from
    payload = {
        "machine": machine(),
        "model": cfg.model.path, "draft": cfg.draft.family, "steps": steps, "checkpoint_every": every,
        "killed_after_step": kill_at, "resumed_from_step": resumed_from, "seed": cfg.run.seed,
        "rl": {"prompts_per_step": cfg.rl.prompts_per_step, "group_size": cfg.rl.group_size,
               "max_new_tokens": cfg.rl.max_new_tokens, "num_speculative_tokens": cfg.rl.num_speculative_tokens},
        "rss_steps": [every, steps],  # RSS after these steps; interrupted: the killed, then the resumed process
        "rss_mb": {name: [rss[name].get(every), rss[name].get(steps)] for name in dirs},
        "rss_growth": growth(rss["uninterrupted"], every, steps),
        "rss_growth_goal": 0.05,
        "metrics_steps_once": {name: [r["step"] for r in rs] == list(range(1, steps + 1)) for name, rs in rows.items()},
        "metrics_equal": not differing and len(rows["interrupted"]) == len(rows["uninterrupted"]),
        "steps_differing": differing,
        "final_metrics": {name: deterministic(rs[-1]) for name, rs in rows.items()},
        "rss_mb_per_step": rss,
    }
    write_results(out_dir, "soak", payload, _table(payload))
    return payload


def _table(p: dict) -> str:
    first, last = p["rss_steps"]
    (u0, u1), (i0, i1) = p["rss_mb"]["uninterrupted"], p["rss_mb"]["interrupted"]

    def mb(x: float | None) -> str:
        return "n/a" if x is None else f"{x:.0f}"

    rows = [
        [f"RSS after step {first} / {last}, uninterrupted (MiB)", f"{mb(u0)} / {mb(u1)}"],
        ["RSS growth, uninterrupted (goal < 5%)", "n/a" if p["rss_growth"] is None else f"{p['rss_growth']:+.1%}"],
        [f"RSS after step {first} (killed process) / {last} (resumed process) (MiB)", f"{mb(i0)} / {mb(i1)}"],
        ["metrics.jsonl holds every step exactly once (interrupted, uninterrupted)",
         f"{p['metrics_steps_once']['interrupted']}, {p['metrics_steps_once']['uninterrupted']}"],
        ["every step's metrics equal the uninterrupted run's (timing and memory aside)", str(p["metrics_equal"])],
    ]
    rl = p["rl"]
    return markdown_table(["soak", "result"], rows) + (
        f"\n{p['steps']} steps of {p['model']} with {p['draft']} speculation (k = {rl['num_speculative_tokens']}, "
        f"rl.adaptive=false), {rl['prompts_per_step']} prompts x group {rl['group_size']}, max "
        f"{rl['max_new_tokens']} new tokens, seed {p['seed']}, a checkpoint every {p['checkpoint_every']} steps; "
        f"the interrupted run was SIGKILLed after step {p['killed_after_step']} and resumed from step "
        f"{p['resumed_from_step']}.\n")
