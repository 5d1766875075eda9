"""Acceptance of a draft measured with the real rollout engine: tau and per-position acceptance at fixed k."""

from __future__ import annotations

import logging

from codraft.config import DraftConfig
from codraft.drafts.base import DraftModel
from codraft.models import Transformer
from codraft.rollout import generate

log = logging.getLogger(__name__)

EVAL_TEMPERATURES = (0.0, 1.0)


def eval_k(draft_cfg: DraftConfig, k: int) -> int:
    """Speculative tokens per verify: `k` for EAGLE-3; one block (block_size - 1) for DFlash/DSpark."""
    return k if draft_cfg.family == "eagle3" else draft_cfg.block_size - 1


def measure_acceptance(policy: Transformer, draft: DraftModel, prompts: list[list[int]], *, k: int,
                       max_new_tokens: int, seed: int, temperatures: tuple[float, ...] = EVAL_TEMPERATURES,
                       verification: str = "block") -> dict:
    """Per temperature: tau (tokens per target forward per row) and the acceptance rate of each draft position,
    sampled drafts judged by `verification` (rollout/verify.py)."""
    results = {"k": k, "prompts": len(prompts), "max_new_tokens": max_new_tokens, "verification": verification}
    for temperature in temperatures:
        stats = generate(policy, prompts, drafter=draft.drafter(), num_speculative_tokens=k, temperature=temperature,
                         max_new_tokens=max_new_tokens, seed=seed, adaptive=False, verification=verification).stats
        results[f"temperature_{temperature:g}"] = {
            "tau": stats.acceptance_length,
            "accept_rate_per_position": stats.accept_rate_per_position,
            "tokens": stats.tokens_generated,
            "draft_tokens": stats.draft_tokens_proposed,
            "accepted_tokens": stats.draft_tokens_accepted,
        }
        log.info("held-out acceptance at temperature %g, k=%d: tau %.3f, per position %s", temperature, k,
                 stats.acceptance_length, [round(r, 3) for r in stats.accept_rate_per_position])
    return results


def acceptance_metrics(results: dict) -> dict[str, float]:
    """`measure_acceptance` results as flat metric names (`eval/t0/acceptance_length`, ...)."""
    metrics = {}
    for temperature in EVAL_TEMPERATURES:
        key = f"temperature_{temperature:g}"
        if key not in results:
            continue
        prefix = f"eval/t{temperature:g}"
        metrics[f"{prefix}/acceptance_length"] = results[key]["tau"]
        metrics |= {f"{prefix}/accept_rate_pos_{i}": r for i, r in enumerate(results[key]["accept_rate_per_position"])}
    return metrics
