"""`codraft bench draft`: a trained draft's acceptance on held-out arithmetic prompts and its rollout speedup.

Acceptance: tau and per-position acceptance at k = 7 (EAGLE-3) or one block (DFlash/DSpark: block 8 => k = 7),
greedy and at temperature 1, with the real rollout engine (stop tokens on, as in RL rollouts).
Speedup: plain decoding against speculative decoding with the draft at that fixed k, per batch size, greedy
and at temperature 1, on the same prompts with the same max_new_tokens (stop tokens off, so both emit the
same number of tokens), medians of interleaved repeats after one warm-up run of each.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from codraft.bench.report import machine, markdown_table, median, timed, write_results
from codraft.commands.common import load_policy
from codraft.config import Config, ConfigError
from codraft.drafts import DraftModel
from codraft.drafts.distill import split_prompts, start_distillation
from codraft.drafts.evaluate import EVAL_TEMPERATURES, eval_k, measure_acceptance
from codraft.drafts.export import check_family, load_draft
from codraft.models import Tokenizer, Transformer
from codraft.observability import progress
from codraft.rollout import Rollout, generate

log = logging.getLogger(__name__)


def bench_draft(cfg: Config) -> dict:
    """The draft of bench.draft_path (or one trained for draft_train.steps) on bench.draft_prompts held-out prompts."""
    if cfg.task.kind != "arithmetic":
        raise ConfigError(f"bench draft measures on held-out arithmetic prompts: task.kind must be arithmetic "
                          f"(got {cfg.task.kind})")
    b = cfg.bench
    policy, tokenizer = load_policy(cfg)
    train_prompts, held_out = split_prompts(cfg, tokenizer, b.draft_prompts)
    draft, training = bench_subject(cfg, policy, tokenizer, train_prompts)
    return run_draft_bench(policy, draft, held_out, k=eval_k(draft.cfg, cfg.draft_train.eval_k),
                           batch_sizes=b.batch_sizes, max_new_tokens=b.max_new_tokens, repeats=b.repeats,
                           out_dir=b.out_dir, training=training)


def bench_subject(cfg: Config, policy: Transformer, tokenizer: Tokenizer,
                  train_prompts: list[list[int]]) -> tuple[DraftModel, dict]:
    """The draft in bench.draft_path, or one distilled for draft_train.steps on the task's training prompts."""
    if cfg.bench.draft_path is not None:
        draft = load_draft(cfg.bench.draft_path, policy)
        if cfg.draft.family != "none":
            check_family(draft, "bench.draft_path", "draft.family", cfg.draft.family)
        return draft, {"draft_path": cfg.bench.draft_path}
    if cfg.draft.family == "none":
        raise ConfigError("bench draft needs bench.draft_path, or draft.family in eagle3, dflash, dspark to train one")
    start = time.perf_counter()
    distiller = start_distillation(cfg, policy, tokenizer, train_prompts)
    losses = [distiller.step()["loss/draft"] for _ in progress(range(cfg.draft_train.steps), desc="bench draft")]
    training = {"steps": cfg.draft_train.steps, "prompts": len(train_prompts), "loss_first": losses[0],
                "loss_last": losses[-1], "seconds": time.perf_counter() - start}
    log.info("trained the %s draft for the benchmark: %s", cfg.draft.family, training)
    return distiller.draft, training


def speed_runs(policy: Transformer, draft: DraftModel, prompts: list[list[int]], k: int,
               max_new_tokens: int) -> dict[str, Callable[[], Rollout]]:
    """Plain (`ar_t*`) and speculative (`spec_t*`) decoding of the same prompts at each eval temperature."""
    common = dict(max_new_tokens=max_new_tokens, stop_token_ids=[], seed=0)
    runs = {}
    for t in EVAL_TEMPERATURES:
        runs[f"ar_t{t:g}"] = lambda t=t: generate(policy, prompts, temperature=t, **common)
        runs[f"spec_t{t:g}"] = lambda t=t: generate(policy, prompts, drafter=draft.drafter(), num_speculative_tokens=k,
                                                    temperature=t, adaptive=False, **common)
    return runs


def measure_speedup(policy: Transformer, draft: DraftModel, prompts: list[list[int]], *, k: int,
                    max_new_tokens: int, repeats: int) -> dict:
    runs = speed_runs(policy, draft, prompts, k, max_new_tokens)
    outputs = {name: fn() for name, fn in runs.items()}  # warm-up
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(repeats):
        for name, fn in runs.items():
            seconds, outputs[name] = timed(fn)
            times[name].append(seconds)
    tokens = len(prompts) * max_new_tokens
    result = {"batch": len(prompts), "times_s": times,
              "tokens_per_s": {name: tokens / median(ts) for name, ts in times.items()},
              "greedy_tokens_identical": outputs["ar_t0"].tokens == outputs["spec_t0"].tokens}
    for t in EVAL_TEMPERATURES:
        result[f"speedup_t{t:g}"] = median(times[f"ar_t{t:g}"]) / median(times[f"spec_t{t:g}"])
        result[f"tau_t{t:g}"] = outputs[f"spec_t{t:g}"].stats.acceptance_length
    log.info("batch %d: speedup %.2fx (t=0), %.2fx (t=1); tau %.2f, %.2f", len(prompts), result["speedup_t0"],
             result["speedup_t1"], result["tau_t0"], result["tau_t1"])
    return result


def run_draft_bench(policy: Transformer, draft: DraftModel, prompts: list[list[int]], *, k: int,
                    batch_sizes: list[int], max_new_tokens: int, repeats: int, out_dir: str,
                    training: dict) -> dict:
    """`prompts` are held out from the draft's training; `training` says where the draft came from."""
    acceptance = measure_acceptance(policy, draft, prompts, k=k, max_new_tokens=max_new_tokens, seed=0)
    speed = [measure_speedup(policy, draft, [prompts[i % len(prompts)] for i in range(batch)], k=k,
                             max_new_tokens=max_new_tokens, repeats=repeats) for batch in batch_sizes]
    payload = {"machine": machine(), "family": draft.family, "k": k, "max_new_tokens": max_new_tokens,
               "repeats": repeats, "training": training, "acceptance": acceptance, "speedup": speed}
    write_results(out_dir, f"draft_{draft.family}", payload, tables(payload))
    return payload


def tables(payload: dict) -> str:
    k, acceptance = payload["k"], payload["acceptance"]
    rows = [[f"{t:g}", k, acceptance[f"temperature_{t:g}"]["tau"],
             " ".join(f"{r:.2f}" for r in acceptance[f"temperature_{t:g}"]["accept_rate_per_position"])]
            for t in EVAL_TEMPERATURES]
    text = markdown_table(["temperature", "k", "tau", "acceptance per position"], rows)
    text += f"\n{payload['family']} draft, {acceptance['prompts']} held-out arithmetic prompts, " \
            f"{payload['max_new_tokens']} new tokens at most.\n\n"
    rows = [[r["batch"], r["tokens_per_s"]["ar_t0"], r["tokens_per_s"]["spec_t0"], r["speedup_t0"], r["tau_t0"],
             r["tokens_per_s"]["ar_t1"], r["tokens_per_s"]["spec_t1"], r["speedup_t1"], r["tau_t1"],
             r["greedy_tokens_identical"]] for r in payload["speedup"]]
    text += markdown_table(["batch", "AR tok/s (t=0)", "spec tok/s (t=0)", "speedup (t=0)", "tau (t=0)",
                            "AR tok/s (t=1)", "spec tok/s (t=1)", "speedup (t=1)", "tau (t=1)",
                            "greedy tokens identical"], rows)
    text += f"\nk = {k} fixed, {payload['max_new_tokens']} new tokens per row (stop tokens off), medians of " \
            f"{payload['repeats']} interleaved repeats.\n"
    return text
