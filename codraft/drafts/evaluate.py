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
                       verification: str = "block", sampled_seeds: int = 1) -> dict:
    """Per temperature: tau (tokens per target forward per row) and the acceptance rate of each draft position,
    sampled drafts judged by `verification` (rollout/verify.py). A temperature > 0 runs at `sampled_seeds` seeds
    (seed, seed + 1, ...) and reports their means beside each seed's tau: one draft's T=1 tau moves by more than
    most levers do from one sampling seed to the next. Greedy runs once (its tokens do not depend on the seed)."""
    results = {"k": k, "prompts": len(prompts), "max_new_tokens": max_new_tokens, "verification": verification}
    for temperature in temperatures:
        runs = [generate(policy, prompts, drafter=draft.drafter(), num_speculative_tokens=k, temperature=temperature,
                         max_new_tokens=max_new_tokens, seed=seed + i, adaptive=False,
                         verification=verification).stats
                for i in range(sampled_seeds if temperature > 0 else 1)]
        taus = [s.acceptance_length for s in runs]
        tau = sum(taus) / len(taus)
        rates = [sum(r) / len(runs) for r in zip(*(s.accept_rate_per_position for s in runs), strict=True)]
        per_seed = {"seeds": [seed + i for i in range(len(runs))], "tau_per_seed": taus} if len(runs) > 1 else {}
        results[f"temperature_{temperature:g}"] = {
            "tau": tau,
            "accept_rate_per_position": rates,
            "tokens": sum(s.tokens_generated for s in runs),
            "draft_tokens": sum(s.draft_tokens_proposed for s in runs),
            "accepted_tokens": sum(s.draft_tokens_accepted for s in runs),
        } | per_seed
        log.info("held-out acceptance at temperature %g, k=%d: tau %.3f (per seed %s), per position %s", temperature, k,
                 tau, [round(t, 3) for t in taus], [round(r, 3) for r in rates])
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
