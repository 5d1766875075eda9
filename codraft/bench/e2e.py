"""`codraft bench e2e`: the report's end-to-end experiment at this machine's scale.

Runs with the same seed, prompts and step budget:
  baseline     no draft, plain decoding
  eagle3/dflash/dspark   co-trained drafts (each warm-started by draft-train, then trained online)
  frozen       the warm-started EAGLE-3 draft, never updated (lambda = 0), as the control
and reports acceptance length, rollout speedup and end-to-end speedup against the baseline, with
plots of reward, train/inference KL and acceptance length against step.
"""

from __future__ import annotations

import copy
import logging
from pathlib import Path

from codraft.bench.report import machine, markdown_table, median, write_results
from codraft.config import Config
from codraft.observability import MetricsLogger
from codraft.train.trainer import Trainer

log = logging.getLogger(__name__)


def run_variants(base: Config, variants: dict[str, dict], out_dir: Path) -> dict[str, list[dict]]:
    """Train every variant (name -> {"dotted.key": value}) from the same base config; metrics per step."""
    history: dict[str, list[dict]] = {}
    for name, overrides in variants.items():
        cfg = copy.deepcopy(base)
        for key, value in overrides.items():
            section, field = key.split(".")
            setattr(getattr(cfg, section), field, value)
        run_dir = out_dir / name
        run_dir.mkdir(parents=True, exist_ok=True)
        cfg.run.dir = str(run_dir)
        log.info("e2e: training %s (%s)", name, overrides)
        trainer = Trainer(cfg, run_dir)
        rows = []
        with MetricsLogger(run_dir, tensorboard=False) as metrics:
            while trainer.step < cfg.rl.steps:
                row = trainer.train_step()
                metrics.log(trainer.step, row)
                rows.append(row | {"step": trainer.step})
        history[name] = rows
    return history


def summarize(history: dict[str, list[dict]], skip_first: int = 1) -> list[dict]:
    """Per run: mean tau, rollout and step time (the first step, which calibrates and warms up, excluded)."""
    base = history["baseline"][skip_first:]
    base_rollout = sum(r["time/rollout_s"] for r in base)
    base_step = sum(r["time/step_s"] for r in base)
    out = []
    for name, rows in history.items():
        rows = rows[skip_first:]
        rollout = sum(r["time/rollout_s"] for r in rows)
        step = sum(r["time/step_s"] for r in rows)
        out.append({
            "run": name,
            "acceptance_length": median([r["spec/acceptance_length"] for r in rows]),
            "acceptance_length_last": rows[-1]["spec/acceptance_length"] if rows else float("nan"),
            "rollout_speedup": base_rollout / rollout,
            "e2e_speedup": base_step / step,
            "reward_first": rows[0]["reward/mean"] if rows else float("nan"),
            "reward_last5": median([r["reward/mean"] for r in rows[-5:]]),
            "kl_train_inference": median([r.get("kl/train_inference", float("nan")) for r in rows]),
        })
    return out


def plot(history: dict[str, list[dict]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = [("reward/mean", "reward"), ("kl/train_inference", "train/inference KL"),
            ("spec/acceptance_length", "acceptance length (tau)")]
    fig, axes = plt.subplots(1, len(keys), figsize=(5 * len(keys), 4))
    for ax, (key, title) in zip(axes, keys, strict=True):
        for name, rows in history.items():
            ax.plot([r["step"] for r in rows], [r.get(key, float("nan")) for r in rows], label=name)
        ax.set_title(title)
        ax.set_xlabel("step")
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def run_e2e_bench(base: Config, draft_paths: dict[str, str], out_dir: str, runs_dir: str | Path) -> dict:
    """draft_paths: family -> warm-started draft directory (from draft-train). Each variant trains in
    <runs_dir>/<variant> (checkpoints stay there); only the tables and plots go to out_dir."""
    out = Path(out_dir)
    variants: dict[str, dict] = {"baseline": {"draft.family": "none"}}
    for family, path in draft_paths.items():
        variants[family] = {"draft.family": family, "checkpoint.draft_init": path}
    if "eagle3" in draft_paths:
        variants["frozen_eagle3"] = {"draft.family": "eagle3", "checkpoint.draft_init": draft_paths["eagle3"],
                                     "rl.draft_weight": 0.0}
    history = run_variants(base, variants, Path(runs_dir))
    summary = summarize(history)
    plot(history, out / "e2e.png")
    header = ["run", "tau (median)", "tau (last step)", "rollout speedup", "e2e speedup", "reward first",
              "reward last 5", "train/inference KL"]
    rows = [[s["run"], s["acceptance_length"], s["acceptance_length_last"], s["rollout_speedup"],
             s["e2e_speedup"], s["reward_first"], s["reward_last5"], s["kl_train_inference"]] for s in summary]
    rl = base.rl
    table = markdown_table(header, rows) + (
        f"\n{rl.steps} steps x {rl.prompts_per_step} prompts x group {rl.group_size}, max {rl.max_new_tokens} new "
        f"tokens, seed {base.run.seed}, model {base.model.path}; speedups are totals over steps 2..N against the "
        "baseline run.\n")
    payload = {"machine": machine(), "summary": summary, "history": history}
    write_results(out, "e2e", payload, table)
    return payload
