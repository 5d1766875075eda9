"""`codraft bench e2e`: the report's end-to-end experiment at this machine's scale.

Runs with the same seed, prompts and step budget (the config given, e.g. `configs/e2e_chain.yaml`):
  baseline                 no draft, plain decoding
  eagle3 / dflash / dspark co-trained drafts (bench.e2e_families), each warm-started from the draft cache
                           (checkpoint.draft_init=auto, distill/warm_start.py), or from the base config's
                           checkpoint.draft_init where that is a draft dir of the family, then trained online
  frozen_<family>          the same warm start, never updated (rl.draft_weight=0): the control
                           (bench.e2e_frozen; best: the co-trained family with the highest last-10 tau)
Every variant is the base config with a few overrides, built through the config loader and validated.
Each trains in <run.dir>/<variant> (default runs/e2e), all in this process, one step of each in turn: this host's
speed drifts by tens of percent over minutes, and variants run one after another measured that drift as well.
A variant that completed (its done marker holds this config) is read back, not re-run; an interrupted one
resumes from its newest checkpoint.

Outputs (bench.out_dir): e2e.json (every run's per-step metrics and the summary), e2e.md (the table) and
e2e.png (reward, train/inference KL, acceptance length, rollout seconds and drift against step). After the runs,
the drafts' acceptance at a fixed k against the policies the runs reached (bench/e2e_acceptance.py; in-run tau
also moves with each controller's k) goes into e2e.json and a table of e2e.md; with rl.frozen_draft_every, so
does each co-trained draft against its initial draft on the same batches (bench/e2e_paired.py).
"""

from __future__ import annotations

import json
import logging
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from codraft.bench.e2e_acceptance import acceptance_at_fixed_k, acceptance_table
from codraft.bench.e2e_paired import paired_rows, paired_table
from codraft.bench.report import machine, markdown_table, write_results
from codraft.config import Config, ConfigError, config_to_dict, save_config, with_overrides
from codraft.drafts.export import exported_family
from codraft.interrupt import StopOnSignal
from codraft.jsonl import read_jsonl
from codraft.observability import MetricsLogger, progress
from codraft.train.checkpoint import latest_checkpoint
from codraft.train.resume import resume_sections
from codraft.train.trainer import Trainer

log = logging.getLogger(__name__)

BASELINE = "baseline"
FROZEN = "frozen_"
DONE = "e2e_done.json"  # written into a variant's run dir when all its steps are logged
WINDOW = 10  # steps averaged for tau first/last and the reward comparison
SKIP_FIRST = 1  # steps left out of the timings: the first warms up the engine and calibrates the controller
MIN_ROLLOUT_SHARE = 0.4  # a baseline below it says the workload does not exercise rollout
PANELS = (("reward/mean", "reward"), ("kl/train_inference", "train/inference KL"),
          ("spec/acceptance_length", "acceptance length (tau)"), ("time/rollout_s", "rollout s"),
          ("drift/kl_step0", "drift: KL to the step-0 policy"))
REWARD_TEST = (f"reward: the last-{WINDOW} per-step mean rewards of a run and of the baseline are compared as two "
               "independent samples; a run is within 2 SE when |difference| <= 2 * sqrt(SE_run^2 + SE_baseline^2), "
               f"SE = stdev / sqrt({WINDOW})")


class Interrupted(Exception):
    """The bench was stopped by a signal after `variant` saved a checkpoint; `exit_code` as a shell reports it."""

    def __init__(self, variant: str, exit_code: int):
        super().__init__(variant)
        self.variant, self.exit_code = variant, exit_code


def warm_start(base: Config, family: str) -> str:
    """The draft a `family` variant starts from: the base config's checkpoint.draft_init when it is a draft dir of
    that family (a warm start distilled beforehand, e.g. with a larger budget), else auto (the draft cache)."""
    init = base.checkpoint.draft_init
    return init if init not in (None, "auto") and exported_family(init) == family else "auto"


def co_trained_overrides(family: str, init: str = "auto") -> list[str]:
    return [f"draft.family={family}", f"checkpoint.draft_init={init}"]


def frozen_overrides(family: str, init: str = "auto") -> list[str]:
    return [*co_trained_overrides(family, init), "rl.draft_weight=0"]


# --- running the variants ----------------------------------------------------------------

def identity(cfg: Config) -> dict:
    """What makes two runs of a variant the same run, by dotted key: the sections a resume must share, the seed."""
    sections = json.loads(json.dumps(resume_sections(cfg)))  # as the marker holds them (tuples become lists)
    return {f"{s}.{k}": v for s, keys in sections.items() for k, v in keys.items()} | {"run.seed": cfg.run.seed}


def read_rows(run_dir: Path) -> list[dict]:
    """The per-step rows of metrics.jsonl (nulls, the non-finite values, as nan)."""
    rows = (row for _, row in read_jsonl(run_dir / "metrics.jsonl"))
    return [{k: math.nan if v is None else v for k, v in row.items()} for row in rows]


def completed(name: str, cfg: Config, run_dir: Path) -> bool:
    """Whether `run_dir` holds a completed run of this variant's config (ConfigError if of another)."""
    done = run_dir / DONE
    if not done.is_file():
        return False
    saved, now = json.loads(done.read_text()), identity(cfg)
    if saved != now:
        differ = sorted(k for k in now.keys() | saved.keys() if saved.get(k) != now.get(k))
        raise ConfigError(f"run.dir: {run_dir} holds a completed {name} run of another config "
                          f"({', '.join(differ)}); give bench e2e a fresh run.dir or remove that directory")
    log.info("e2e: %s is complete in %s; not re-run", name, run_dir)
    return True


class VariantRun:
    """One variant's trainer, stepped in turn with the others' in this process. It keeps its own torch RNG
    stream (draft init, anchor sampling), so taking turns leaves every variant's trajectory what it is alone."""

    def __init__(self, name: str, cfg: Config, run_dir: Path):
        overrides = [f"run.dir={run_dir}"]
        try:
            latest_checkpoint(run_dir)
            overrides.append(f"checkpoint.resume={run_dir}")
        except FileNotFoundError:
            pass  # nothing saved yet: from the start
        self.name, self.cfg, self.run_dir = name, with_overrides(cfg, overrides), run_dir
        run_dir.mkdir(parents=True, exist_ok=True)
        save_config(self.cfg, run_dir / "config.yaml")
        self.trainer = Trainer(self.cfg, run_dir)  # seeds the global RNG, restores it on resume
        self.rng = torch.get_rng_state()
        self.metrics = MetricsLogger(run_dir, self.cfg.run.tensorboard, self.trainer.step)
        log.info("e2e: training %s in %s from step %d", name, run_dir, self.trainer.step)

    @property
    def done(self) -> bool:
        return self.trainer.step >= self.cfg.rl.steps

    def _own_rng(self, work):
        torch.set_rng_state(self.rng)
        try:
            return work()
        finally:
            self.rng = torch.get_rng_state()

    def step(self) -> None:
        t, every, steps = self.trainer, self.cfg.checkpoint.every, self.cfg.rl.steps
        row = self._own_rng(t.train_step)
        self.metrics.log(t.step, row)
        log.info("e2e %s step %d/%d: reward %.3f  tau %.2f  rollout %.1f s  step %.1f s", self.name, t.step, steps,
                 row["reward/mean"], row["spec/acceptance_length"], row["time/rollout_s"], row["time/step_s"])
        if every and t.step % every == 0 and t.step < steps:
            self._own_rng(t.save)

    def close(self) -> None:
        """Save the newest state; mark the variant complete when it reached rl.steps."""
        self._own_rng(self.trainer.save)
        self.metrics.close()
        if self.done:
            (self.run_dir / DONE).write_text(json.dumps(identity(self.cfg), indent=1) + "\n")


def run_variants(runs: dict[str, tuple[Config, Path]]) -> dict[str, list[dict]]:
    """Train every variant to its rl.steps, one step of each in turn (a host whose speed drifts over minutes
    slows them alike), each resuming its newest checkpoint -> {name: per-step rows}. A variant whose done
    marker holds its config is read back instead."""
    live = [VariantRun(name, cfg, run_dir) for name, (cfg, run_dir) in runs.items()
            if not completed(name, cfg, run_dir)]
    with StopOnSignal() as stop:
        try:
            with progress(sum(v.cfg.rl.steps - v.trainer.step for v in live),
                          desc="e2e " + " / ".join(v.name for v in live)) as bar:
                while stop.signum is None and not all(v.done for v in live):
                    for v in (v for v in live if not v.done):
                        v.step()
                        bar.update()
                        if stop.signum is not None:
                            break
        except BaseException:  # a failed step: what was logged stays, nothing half-trained is saved
            for v in live:
                v.metrics.close()
            raise
    for v in live:
        v.close()
    if stop.signum is not None:
        raise Interrupted(next((v.name for v in live if not v.done), "e2e"), stop.exit_code)
    return {name: read_rows(run_dir) for name, (_, run_dir) in runs.items()}


def run_e2e_bench(base: Config, out_dir: str | Path, runs_dir: str | Path) -> dict:
    """Every variant over `base`'s workload, then the summary, table, JSON and plot in `out_dir`."""
    if base.checkpoint.resume is not None:
        raise ConfigError("checkpoint.resume: bench e2e resumes each variant from its own run dir; leave it unset "
                          f"(got {base.checkpoint.resume!r})")
    runs_dir = Path(runs_dir)
    b = base.bench
    variants = {BASELINE: ["draft.family=none", "checkpoint.draft_init=none"]} | {
        f: co_trained_overrides(f, warm_start(base, f)) for f in b.e2e_families}
    if b.e2e_frozen not in ("best", "none"):  # named: it takes turns with the others
        variants[FROZEN + b.e2e_frozen] = frozen_overrides(b.e2e_frozen, warm_start(base, b.e2e_frozen))
    runs = {name: (with_overrides(base, overrides), runs_dir / name)  # all refused up front
            for name, overrides in variants.items()}
    history = run_variants(runs)
    best = best_family(history, b.e2e_families) if b.e2e_frozen == "best" else None
    if best is not None:  # known only now: it runs after the others, alone (its timings did not take turns)
        name = FROZEN + best
        log.warning("e2e: bench.e2e_frozen=best: %s runs after the other variants, not in turn with them; name a "
                    "family to interleave it", name)
        variants[name] = frozen_overrides(best, warm_start(base, best))
        runs[name] = (with_overrides(base, variants[name]), runs_dir / name)
        history |= run_variants({name: runs[name]})
    return write_outputs(history, variants, base, out_dir, acceptance_at_fixed_k(base, runs))


def write_outputs(history: dict[str, list[dict]], variants: dict[str, list[str]], base: Config,
                  out_dir: str | Path, acceptance: list[dict] | None = None) -> dict:
    """e2e.json, e2e.md and e2e.png from the runs' per-step rows (and `acceptance_at_fixed_k`'s) -> the JSON
    payload."""
    summary = summarize(history)
    payload = {"machine": machine(), "workload": workload(base), "variants": variants, "reward_test": REWARD_TEST,
               "summary": summary, "history": history, "acceptance_at_fixed_k": acceptance or []}
    paired = paired_rows(history)
    payload["trained_vs_initial_draft"] = paired
    markdown = table(summary, base)
    if paired:
        markdown += "\n" + paired_table(paired)
    if acceptance:
        markdown += "\n" + acceptance_table(acceptance, base)
    write_results(out_dir, "e2e", payload, markdown)
    plot(history, Path(out_dir) / "e2e.png")
    return payload


def best_family(history: dict[str, list[dict]], families: list[str]) -> str | None:
    """The co-trained family with the highest mean tau over its last WINDOW steps (None without any)."""
    return max(families, key=lambda f: window_mean(history[f], "spec/acceptance_length", last=True), default=None)


def workload(cfg: Config) -> dict:
    sections = config_to_dict(cfg)
    return {s: sections[s] for s in ("model", "task", "rl", "optim", "draft_train")} | {"seed": cfg.run.seed}


# --- the summary -------------------------------------------------------------------------

def finite(xs: list[float]) -> list[float]:
    return [x for x in xs if x == x]


def known(x: float) -> float | None:
    """None for a figure a run has none of (the baseline's acceptance), so the JSON round-trips equal."""
    return None if x != x else x


def mean_se(xs: list[float]) -> tuple[float, float]:
    """Mean and standard error of the finite values (nan where there are too few)."""
    xs = finite(xs)
    mean = statistics.fmean(xs) if xs else math.nan
    se = statistics.stdev(xs) / math.sqrt(len(xs)) if len(xs) >= 2 else math.nan
    return mean, se


@dataclass(frozen=True)
class RunSpeedup:
    """A run's measured steps together: plain seconds over speculative seconds, so a long rollout weighs what it
    takes (one step's answers run 10-192 tokens, its ratio 0.9-1.8x: README, stop 46), with the standard error of
    the per-step ratios' mean (nan under two steps) and their median."""

    ratio: float
    se: float
    median: float
    steps: int


def run_speedup(plain_s: Sequence[float], spec_s: Sequence[float]) -> RunSpeedup | None:
    """The measured steps' plain and speculative seconds, step by step -> their RunSpeedup (None without steps);
    `codraft train` closes a run with the same figure."""
    if not spec_s:
        return None
    ratios = [p / s for p, s in zip(plain_s, spec_s, strict=True)]
    return RunSpeedup(sum(plain_s) / sum(spec_s), mean_se(ratios)[1], statistics.median(ratios), len(ratios))


def window_mean(rows: list[dict], key: str, last: bool) -> float:
    picked = rows[-WINDOW:] if last else rows[:WINDOW]
    return mean_se([r.get(key, math.nan) for r in picked])[0]


def per_second_ratio(work: float, seconds: float, base_work: float, base_seconds: float) -> float:
    """Throughput over the baseline's: work / seconds against base_work / base_seconds (nan where a total is 0)."""
    return (work / seconds) / (base_work / base_seconds) if seconds and base_work and base_seconds else math.nan


def timed_totals(rows: list[dict], steps: set[int]) -> tuple[float, float, float]:
    """Total rollout seconds, step seconds and the steps' mean response lengths summed over `steps` (response
    tokens over the rows of a step, which every variant shares)."""
    picked = [r for r in rows if r["step"] in steps]
    return (sum(r["time/rollout_s"] for r in picked), sum(r["time/step_s"] for r in picked),
            sum(r["response_length/mean"] for r in picked))


def summarize(history: dict[str, list[dict]]) -> list[dict]:
    """Per run, from its measured per-step metrics: tau first/last WINDOW, rollout share of the step, rollout and
    end-to-end speedup (the baseline's total seconds over the run's, on the steps both ran, the first SKIP_FIRST
    left out), last-WINDOW reward with its SE and the 2-SE comparison with the baseline, KL and the last drift."""
    base = history[BASELINE]
    base_reward, base_se = mean_se([r["reward/mean"] for r in base[-WINDOW:]])
    out = []
    for name, rows in history.items():
        steps = {r["step"] for r in rows} & {r["step"] for r in base}
        steps = {s for s in steps if s > SKIP_FIRST}
        rollout, step, tokens = timed_totals(rows, steps)
        base_rollout, base_step, base_tokens = timed_totals(base, steps)
        reward, se = mean_se([r["reward/mean"] for r in rows[-WINDOW:]])
        diff, bound = reward - base_reward, 2 * math.sqrt(se**2 + base_se**2)
        drift = finite([r.get("drift/kl_step0", math.nan) for r in rows])
        measured = [r for r in rows if math.isfinite(r.get("rollout/speedup_measured", math.nan))]
        in_run = run_speedup([r["rollout/plain_s"] for r in measured], [r["rollout/spec_s"] for r in measured])
        steps_in_run = [r for r in measured if math.isfinite(r.get("step/speedup_measured", math.nan))]
        e2e_in_run = run_speedup([r["step/plain_s"] for r in steps_in_run], [r["time/step_s"] for r in steps_in_run])
        tau_last, tau_last_se = mean_se([r.get("spec/acceptance_length", math.nan) for r in rows[-WINDOW:]])
        out.append({
            "run": name,
            "steps": len(rows),
            "timed_steps": len(steps),
            "tau_first": window_mean(rows, "spec/acceptance_length", last=False),
            "tau_last": tau_last,
            # the step-to-step spread a gap between two runs' tau must clear (issue 14: co-trained vs frozen)
            "tau_last_se": known(tau_last_se),
            # tau moves with the controller's k; the first draft position's acceptance does not
            "accept1_first": known(window_mean(rows, "spec/accept_rate_pos_0", last=False)),
            "accept1_last": known(window_mean(rows, "spec/accept_rate_pos_0", last=True)),
            "mean_k": known(mean_se([r.get("spec/mean_k", math.nan) for r in rows])[0]),
            "rollout_share": rollout / step if step else math.nan,
            "rollout_speedup": base_rollout / rollout if rollout else math.nan,
            # against plain decoding of the same rows to the same lengths, in the run (rl.measure_speedup_every)
            "rollout_speedup_in_run": in_run.ratio if in_run else None,
            "rollout_speedup_in_run_se": known(in_run.se) if in_run else None,  # of the per-step ratios' mean
            "rollout_speedup_in_run_median": in_run.median if in_run else None,
            "rollout_speedup_in_run_steps": in_run.steps if in_run else 0,
            "e2e_speedup": base_step / step if step else math.nan,
            # the same steps without a draft: rollout decoded plainly, no draft training (rollout/speedup.py)
            "e2e_speedup_in_run": e2e_in_run.ratio if e2e_in_run else None,
            "e2e_speedup_in_run_se": known(e2e_in_run.se) if e2e_in_run else None,
            "e2e_speedup_in_run_steps": e2e_in_run.steps if e2e_in_run else 0,
            # sampled runs part ways: a run that drew shorter answers did less work in its seconds
            "tokens_vs_baseline": tokens / base_tokens if base_tokens else math.nan,
            "rollout_tokens_per_s_vs_baseline": per_second_ratio(tokens, rollout, base_tokens, base_rollout),
            # the whole step's throughput: its seconds alone (e2e_speedup) also credit a run for shorter answers
            "step_tokens_per_s_vs_baseline": per_second_ratio(tokens, step, base_tokens, base_step),
            "reward_last": reward,
            "reward_last_se": se,
            "reward_diff": diff,
            "reward_within_2se": None if name == BASELINE or bound != bound else abs(diff) <= bound,
            "kl_train_inference": mean_se([r.get("kl/train_inference", math.nan) for r in rows])[0],
            "drift_last": drift[-1] if drift else math.nan,
        })
    return out


def table(summary: list[dict], cfg: Config) -> str:
    header = ["run", "steps", f"tau first {WINDOW}", f"tau last {WINDOW} ± SE", f"accept pos 1 first / last {WINDOW}",
              "mean k", "rollout share", "rollout speedup", "rollout speedup in run", "e2e speedup",
              "e2e speedup in run",
              "response tokens vs baseline", "rollout tokens/s vs baseline", "step tokens/s vs baseline",
              f"reward last {WINDOW} ± SE",
              "reward - baseline", "within 2 SE", "train/inference KL", "drift (last)"]
    yes_no = {True: "yes", False: "no", None: "n/a"}  # n/a: the baseline itself, or too few steps for an SE

    def in_run(s: dict, name: str) -> str:
        x, se = s[f"{name}_in_run"], s[f"{name}_in_run_se"]
        if x is None:
            return "n/a"
        return f"{x:.3g}{'' if se is None else f' ± {se:.2g}'} ({s[f'{name}_in_run_steps']})"

    def tau_last(s: dict) -> str:
        return f"{s['tau_last']:.3g}" + ("" if s["tau_last_se"] is None else f" ± {s['tau_last_se']:.2g}")

    rows = [[s["run"], s["steps"], s["tau_first"], tau_last(s),
             " / ".join("n/a" if s[k] is None else f"{s[k]:.3g}" for k in ("accept1_first", "accept1_last")),
             "n/a" if s["mean_k"] is None else s["mean_k"], s["rollout_share"],
             s["rollout_speedup"], in_run(s, "rollout_speedup"), s["e2e_speedup"], in_run(s, "e2e_speedup"),
             s["tokens_vs_baseline"],
             s["rollout_tokens_per_s_vs_baseline"], s["step_tokens_per_s_vs_baseline"],
             f"{s['reward_last']:.3f} ± {s['reward_last_se']:.3f}", s["reward_diff"],
             yes_no[s["reward_within_2se"]], s["kl_train_inference"], s["drift_last"]] for s in summary]
    rl, task = cfg.rl, cfg.task
    base = next(s for s in summary if s["run"] == BASELINE)
    terms = f" ({task.chain_min_terms}-{task.chain_max_terms} terms)" if task.kind == "chain" else ""
    notes = [
        f"{rl.steps} steps x {rl.prompts_per_step} prompts x group {rl.group_size}, max {rl.max_new_tokens} new "
        f"tokens at T={rl.temperature:g}, task {task.kind}{terms}, seed {cfg.run.seed}, "
        f"model {cfg.model.path}, k {rl.num_speculative_tokens} ({'adaptive' if rl.adaptive else 'fixed'}).",
        "Every figure is measured in these runs (no estimate): speedups are the baseline's total wall-clock seconds "
        f"(time/rollout_s, time/step_s) over the run's, on the same steps ({base['timed_steps']} steps: step "
        f"{SKIP_FIRST + 1} on; step 1 warms up and is left out; a step's seconds leave out what measures the run: "
        "the drift probe, the in-run plain decoding and the frozen control's scoring); rollout share = total "
        "rollout s / total step s over those steps; tau = tokens per verify forward, mean over the first / last "
        f"{WINDOW} steps (± the standard error of the last steps' values: the step-to-step spread a gap between "
        "two runs must clear), "
        "which moves with the controller's k (mean k: its mean per verify forward in each step, averaged over the "
        "run's steps); accept pos 1 = the share of first draft tokens accepted, a measure of the draft alone, "
        "per-step means over the same steps. Sampled runs part ways, so their answers' lengths differ: response "
        "tokens vs baseline is the run's total over the baseline's on those steps, rollout (step) tokens/s vs "
        "baseline the ratio of response tokens per rollout (step) second.",
        "Rollout speedup in run: on the steps in brackets, the run's own rollouts against plain decoding of the same "
        "prompts to the same row lengths timed right after each (rl.measure_speedup_every="
        f"{rl.measure_speedup_every}), total plain seconds over total speculative seconds (± the standard error of "
        "the per-step ratios' mean): free of the runs' different answer lengths and of the minutes between runs. "
        "E2e speedup in run: on those steps, each step's seconds against the same step without a draft, whose "
        "seconds are the step's own with its rollout replaced by that plain decoding and its draft's training "
        "(time/draft_train_s: the draft loss's forward and backward, clip, optimizer step) taken out, each part timed "
        "in the step; the policy's update is the same work either way. Not one timed run of a draft-free step: "
        "its parts, timed.",
        f"{REWARD_TEST}. Drift: drift/kl_step0 at its last measurement (rl.drift_every={rl.drift_every}).",
    ]
    if base["rollout_share"] < MIN_ROLLOUT_SHARE:
        notes.append(f"The baseline spent {base['rollout_share']:.0%} of its step in rollout (< "
                     f"{MIN_ROLLOUT_SHARE:.0%}): on this workload speculation has little of the step to speed up.")
    return markdown_table(header, rows) + "\n" + "\n\n".join(notes) + "\n"


def plot(history: dict[str, list[dict]], path: Path) -> None:
    try:
        import matplotlib
    except ImportError:
        log.warning("no plot: matplotlib is not installed (pip install 'codraft[dev]')")
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(PANELS), figsize=(4.5 * len(PANELS), 4))
    for ax, (key, title) in zip(axes, PANELS, strict=True):
        for name, rows in history.items():
            points = [(r["step"], r[key]) for r in rows if r.get(key, math.nan) == r.get(key, math.nan)]
            ax.plot([s for s, _ in points], [v for _, v in points], marker="." if len(points) < 20 else None,
                    label=name)
        ax.set_title(title)
        ax.set_xlabel("step")
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    log.info("wrote %s", path)
