"""`codraft draft-train`: warm-start a draft by distillation on the policy's own responses, before RL.

Writes `<run_dir>/metrics.jsonl`, the exported draft `<run_dir>/draft/` (every `draft_train.save_every`
steps and at the end, atomically) and `<run_dir>/eval.json`: held-out acceptance with the real rollout
engine at temperature 0 and 1 (T=1: the mean over `draft_train.eval_seeds` sampling seeds, and each).
Start RL from it with `codraft train checkpoint.draft_init=<run_dir>/draft`.
"""

from __future__ import annotations

import json
import logging

from codraft.config import DRAFT_FAMILIES, Config, ConfigError
from codraft.distill.distill import distillation_prompts, live_accuracy, split_prompts, start_distillation
from codraft.drafts.evaluate import acceptance_metrics, eval_k, measure_acceptance
from codraft.drafts.export import export_draft
from codraft.host_memory import step_end
from codraft.models import load_policy
from codraft.observability import MetricsLogger, prepare_run_dir, progress

log = logging.getLogger(__name__)


def main(cfg: Config) -> int:
    if cfg.draft.family == "none":
        raise ConfigError(f"draft.family must be one of {', '.join(DRAFT_FAMILIES)} for draft-train (got 'none')")
    dt = cfg.draft_train
    policy, tokenizer = load_policy(cfg)
    train_prompts, held_out = split_prompts(cfg, tokenizer, dt.held_out_prompts)
    run_dir = prepare_run_dir(cfg, "draft-train")  # once every input is read: a refused run leaves nothing behind
    distiller = start_distillation(cfg, policy, tokenizer, train_prompts)
    draft, trained_on = distiller.draft, distillation_prompts(cfg)
    with MetricsLogger(run_dir, tensorboard=cfg.run.tensorboard) as metrics:
        bar = progress(range(1, dt.steps + 1), desc=f"draft-train {cfg.draft.family}")
        for step in bar:
            step_metrics = distiller.step() | step_end(cfg.run.host_memory)
            metrics.log(step, step_metrics)
            live = {"loss": step_metrics["loss/draft"], "acc": live_accuracy(step_metrics)}
            bar.set_postfix({name: f"{v:.3f}" for name, v in live.items()})
            log.debug("step %d/%d  loss %.4f  acc %.3f", step, dt.steps, live["loss"], live["acc"])
            if dt.save_every and step % dt.save_every == 0 and step < dt.steps:
                export_draft(draft, run_dir / "draft", trained_on)
        export_draft(draft, run_dir / "draft", trained_on)
        k = eval_k(cfg.draft, dt.eval_k)
        results = measure_acceptance(policy, draft, held_out, k=k, max_new_tokens=dt.eval_max_new_tokens,
                                     seed=cfg.run.seed, sampled_seeds=dt.eval_seeds)
        metrics.log(dt.steps, acceptance_metrics(results))
    (run_dir / "eval.json").write_text(json.dumps(results | {"family": cfg.draft.family, "steps": dt.steps},
                                                  indent=2) + "\n")
    log.info("draft-train done: %s; tau %.3f (t=0), %.3f (t=1, mean of %d seeds) at k=%d on %d held-out prompts",
             run_dir / "draft", results["temperature_0"]["tau"], results["temperature_1"]["tau"], dt.eval_seeds, k,
             len(held_out))
    return 0
