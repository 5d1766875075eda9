"""`bench e2e`'s drafts measured at a fixed k against the policies the runs reached: their accuracy alone.

A run's tau moves with its controller's k: one whose controller keeps speculation off reads ~1 however good its
draft is, so in-run tau compares controllers as much as drafts. After the runs, the final policy of each
speculative run answers the drift probe's held-out prompts (never trained on, but for a JSONL dataset's) at
k = draft_train.eval_k with no controller, drafted by the run's own final draft and, for a co-trained run, by the
warm start it began from: the frozen control's draft against the policy the co-trained run reached. The step-0
policy with each warm start is the reference. Every row decodes the same prompts with the same seed.
"""

from __future__ import annotations

import logging
from pathlib import Path

from codraft.bench.report import markdown_table
from codraft.config import Config, ConfigError
from codraft.distill.warm_start import initial_draft
from codraft.drafts.base import DraftModel
from codraft.drafts.evaluate import EVAL_TEMPERATURES, eval_k, measure_acceptance
from codraft.models import load_policy
from codraft.rl.drift import HELD_OUT_START
from codraft.rl.prompts import prompt_encoder
from codraft.rl.tasks import build_task
from codraft.train.checkpoint import load_policy_state, load_weights

log = logging.getLogger(__name__)

STEP0 = "step 0"


def acceptance_at_fixed_k(base: Config, runs: dict[str, tuple[Config, Path]]) -> list[dict]:
    """One row per (policy, draft) measured: {"policy", "draft", "k", "tau_t0", "tau_t1", "accept1_t0", ...}.
    `runs`: every variant's config and run dir (those without a draft are left out)."""
    b = base.bench
    drafted = {name: (cfg, run_dir) for name, (cfg, run_dir) in runs.items() if cfg.draft.family != "none"}
    if not b.e2e_eval_prompts or not drafted:
        return []
    policy, tokenizer = load_policy(base)
    encode, task = prompt_encoder(base, policy, tokenizer), build_task(base)
    prompts = [encode(task.problem(HELD_OUT_START + i)) for i in range(b.e2e_eval_prompts)]
    rows = []

    def measure(policy_name: str, draft_name: str, draft: DraftModel, cfg: Config) -> None:
        k = eval_k(cfg.draft, cfg.draft_train.eval_k)
        log.info("e2e acceptance at k=%d: %s policy, %s draft", k, policy_name, draft_name)
        result = measure_acceptance(policy, draft, prompts, k=k, max_new_tokens=b.e2e_eval_max_new_tokens,
                                    seed=base.run.seed)
        row = {"policy": policy_name, "draft": draft_name, "k": k}
        for t in EVAL_TEMPERATURES:
            at = result[f"temperature_{t:g}"]
            row[f"tau_t{t:g}"], row[f"accept1_t{t:g}"] = at["tau"], at["accept_rate_per_position"][0]
        rows.append(row)

    # every draft is built while `policy` holds the step-0 weights: a cached warm start is keyed on them (a later
    # policy would miss the cache and distil again). Drafts borrow the policy's embedding and head, which follow
    # what it loads.
    families: dict[str, Config] = {}  # a family's runs all start from its one warm start
    for cfg, _ in drafted.values():
        families.setdefault(cfg.draft.family, cfg)
    warm = {family: initial_draft(cfg, policy, tokenizer) for family, cfg in families.items()}
    own = {name: initial_draft(cfg, policy, tokenizer) for name, (cfg, _) in drafted.items()}
    for family, cfg in families.items():
        measure(STEP0, f"{family} warm start", warm[family], cfg)
    for name, (cfg, run_dir) in drafted.items():
        try:
            path, weights = load_weights(run_dir)
        except FileNotFoundError as e:  # a completed run read back after its checkpoints were removed
            log.warning("e2e acceptance at fixed k: %s has no checkpoint to measure (%s): its final policy and "
                        "draft are left out", name, e)
            continue
        try:
            load_policy_state(policy, weights["policy"])
            own[name].load_state_dict(weights["draft"])
        except (KeyError, ValueError, RuntimeError) as e:  # a pipeline-parallel run's stages, another config
            raise ConfigError(f"run.dir: the {name} checkpoint {path} does not hold this run's policy and draft "
                              f"weights ({e})") from None
        at = f"{name} final"
        measure(at, at, own[name], cfg)
        if cfg.rl.draft_weight:  # co-trained: what its warm start, never updated, would accept here
            measure(at, f"{cfg.draft.family} warm start", warm[cfg.draft.family], cfg)
    return rows


def acceptance_table(rows: list[dict], base: Config) -> str:
    """The rows as Markdown, with what was measured."""
    if not rows:
        return ""
    b = base.bench
    text = markdown_table(["policy", "draft", "tau T=0", "tau T=1", "accept pos 1 T=0", "accept pos 1 T=1"],
                          [[r["policy"], r["draft"], r["tau_t0"], r["tau_t1"], r["accept1_t0"], r["accept1_t1"]]
                           for r in rows])
    k = sorted({r["k"] for r in rows})
    held_out = ("prompts of the JSONL dataset (it has no held-out rows: they are training prompts too)"
                if base.task.kind == "jsonl" else "held-out prompts (never trained on)")
    return (text + "\n"
            f"Acceptance at fixed k = {', '.join(map(str, k))} (no controller) of each run's final draft and, for a "
            "co-trained run, of its warm start (the frozen control's draft), against the policy each run reached "
            f"at its last step; the step-0 policy with each warm start for reference. {b.e2e_eval_prompts} {held_out}, "
            f"up to {b.e2e_eval_max_new_tokens} new tokens, stop tokens on, seed "
            f"{base.run.seed}; tau = tokens per verify forward per row.\n")
