"""`codraft bench draft`: a trained draft's acceptance on held-out task prompts and its rollout speedup.

Held out: the prompts after the first draft_train.num_prompts of the task stream, or, for a loaded draft that
records the prompts it was distilled on (`codraft_trained_on`) from this stream (rl.tasks.task_stream), after
those where they are more; a draft that records none is warned about (it may have learned from the bench's prompts).

Acceptance: tau and per-position acceptance at k = 7 (EAGLE-3) or one block (DFlash/DSpark: block 8 => k = 7),
greedy and at temperature 1, with the real rollout engine (stop tokens on, as in RL rollouts).
Speedup: plain decoding against speculative decoding with the draft, adaptive k (what `generate` and `train`
use; one controller per batch size and temperature kept across repeats, as the trainer keeps one across steps)
and beside it the fixed k, per batch size, greedy and at temperature 1, on the same prompts (up to
SPEED_GROUPS batches of held-out prompts one after the other, so batch 1 is not one prompt's luck) with the same
max_new_tokens (stop tokens off by default, so every run emits the same number of tokens; `bench.stop_tokens=true`
ends rows at EOS as RL rollouts do: greedy runs still emit the same tokens, sampled ones the same distribution,
and speedups are ratios of tokens per second), medians of interleaved repeats after one warm-up run of each.
With stop tokens on, sampled (T > 0) runs also end at different lengths, so beside them a length-matched plain
run decodes, in each round after the adaptive run, with stop tokens off and every row limited to the length
the adaptive run gave it in that round (plain decoding's cost depends on token counts and contexts, not on which
tokens); its speedup is the median over rounds of that run's time / the adaptive run's time.
Each cell also gives its rounds' spread: plain time / adaptive time round by round, of the same tokens (stop tokens
off or greedy: the plain run; else the length-matched one). On a shared 2-core host one round of a cell whose
controller is off moves by +-5-10%, more than a 0.97 floor's margin; the spread says how far a median can be trusted.
Beside it the decode phase alone (each round's prefill seconds taken out of its time) and the prefill's share of
plain decoding's time: at 48 new tokens a batch of 8 spent ~30% of its time in the prefill (README), which a
draft cannot shorten.
Past EOS (stop tokens off): the share of plain decoding's tokens that come after each row's first stop token, text
a rollout never produces and a draft distilled from rollouts never saw (on the chain task at 48 tokens, half of a
greedy run's: its answers end after 8-19 tokens), so its acceptance there is not the acceptance RL rollouts get.
Draft cost: the draft's seconds per proposal (per drafted token for EAGLE-3's chain, per block for DFlash/DSpark)
at fixed k, as a share of a plain decode step at the same batch; the first proposal of each call, which absorbs
the prompt, is counted as prefill.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable, Sequence
from itertools import accumulate
from typing import TypeVar

from codraft.bench.report import interleaved, machine, markdown_table, median, write_results
from codraft.config import DRAFT_FAMILIES, Config, ConfigError, with_overrides
from codraft.distill.distill import split_prompts, start_distillation
from codraft.drafts import DraftModel
from codraft.drafts.evaluate import EVAL_TEMPERATURES, eval_k, measure_acceptance
from codraft.drafts.export import check_family, exported_trained_on, load_draft
from codraft.models import Tokenizer, Transformer, load_policy
from codraft.observability import progress
from codraft.rl.tasks import task_stream
from codraft.rollout import Rollout, RolloutStats, SpeculationController, generate
from codraft.rollout.speedup import plain_at

log = logging.getLogger(__name__)

SPEED_GROUPS = 4  # batches of distinct held-out prompts per timed run

G = TypeVar("G")


def bench_draft(cfg: Config) -> dict:
    """The draft of bench.draft_path (or one trained for draft_train.steps) on bench.draft_prompts held-out prompts."""
    if cfg.task.kind == "jsonl":
        raise ConfigError("bench draft measures on held-out generated prompts: task.kind must be arithmetic, chain "
                          "or lists (got jsonl)")
    b = cfg.bench
    if b.draft_path is not None:
        cfg = past_training_prompts(cfg, b.draft_path)
    policy, tokenizer = load_policy(cfg)
    train_prompts, held_out = split_prompts(cfg, tokenizer, b.draft_prompts)
    draft, training = bench_subject(cfg, policy, tokenizer, train_prompts)
    training |= {"task": cfg.task.kind, "held_out_after": cfg.draft_train.num_prompts}
    return run_draft_bench(policy, draft, held_out, k=eval_k(draft.cfg, cfg.draft_train.eval_k),
                           batch_sizes=b.batch_sizes, max_new_tokens=b.max_new_tokens, repeats=b.repeats,
                           out_dir=b.out_dir, training=training, stop_tokens=b.stop_tokens,
                           verification=b.verification)


def past_training_prompts(cfg: Config, draft_path: str) -> Config:
    """`cfg` with draft_train.num_prompts raised to the prompts of this task stream the draft in `draft_path` was
    distilled on, so that the held-out prompts (those after) are ones it never learned from."""
    record, n = exported_trained_on(draft_path), cfg.draft_train.num_prompts
    if not isinstance(record, dict) or not isinstance(record.get("num_prompts"), int):
        log.warning("bench.draft_path %s does not record the prompts it was trained on: the held-out prompts are "
                    "those after the first draft_train.num_prompts=%d of the task stream, held out only if it "
                    "learned from no more of them", draft_path, n)
        return cfg
    if record.get("stream") != task_stream(cfg):
        log.warning("bench.draft_path %s was distilled on another task stream (%s): the held-out prompts are those "
                    "after draft_train.num_prompts=%d of this one", draft_path, record.get("stream"), n)
        return cfg
    if record["num_prompts"] <= n:
        return cfg
    log.info("bench.draft_path %s was distilled on the first %d prompts of this task stream: held-out prompts are "
             "those after them (draft_train.num_prompts=%d)", draft_path, record["num_prompts"], n)
    return with_overrides(cfg, [f"draft_train.num_prompts={record['num_prompts']}"])


def bench_subject(cfg: Config, policy: Transformer, tokenizer: Tokenizer,
                  train_prompts: list[list[int]]) -> tuple[DraftModel, dict]:
    """The draft in bench.draft_path, or one distilled for draft_train.steps on the task's training prompts."""
    if cfg.bench.draft_path is not None:
        draft = load_draft(cfg.bench.draft_path, policy, cfg.draft.inference_dtype)
        if cfg.draft.family != "none":
            check_family(draft, "bench.draft_path", "draft.family", cfg.draft.family)
        return draft, {"draft_path": cfg.bench.draft_path}
    if cfg.draft.family == "none":
        raise ConfigError(f"bench draft needs bench.draft_path, or draft.family in {', '.join(DRAFT_FAMILIES)} "
                          "to train one")
    start = time.perf_counter()
    distiller = start_distillation(cfg, policy, tokenizer, train_prompts)
    losses = [distiller.step()["loss/draft"] for _ in progress(range(cfg.draft_train.steps), desc="bench draft")]
    training = {"steps": cfg.draft_train.steps, "prompts": len(train_prompts), "loss_first": losses[0],
                "loss_last": losses[-1], "seconds": time.perf_counter() - start}
    log.info("trained the %s draft for the benchmark: %s", cfg.draft.family, training)
    return distiller.draft, training


def prompt_groups(prompts: list[list[int]], batch: int) -> list[list[list[int]]]:
    """Up to SPEED_GROUPS batches of `batch` prompts, distinct while the held-out prompts last (then cycled)."""
    n = max(1, min(SPEED_GROUPS, len(prompts) // batch))
    return [[prompts[(g * batch + i) % len(prompts)] for i in range(batch)] for g in range(n)]


def in_turn(groups: Sequence[G], run: Callable[[G], Rollout]) -> Rollout:
    """`run` on each group one after the other, as one Rollout (rows in order, stats added)."""
    rollouts = [run(group) for group in groups]
    stats = RolloutStats()
    for r in rollouts:
        stats.merge(r.stats)
    return Rollout(*(sum((getattr(r, name) for r in rollouts), []) for name in
                     ("prompts", "tokens", "logprobs", "finish_reasons")), stats)


def length_matched(groups: list[list[list[int]]], spec: Callable[[], Rollout],
                   plain_at: Callable[[list[list[int]], list[int]], Rollout]
                   ) -> tuple[Callable[[], Rollout], Callable[[], Rollout]]:
    """`spec`, keeping its latest output, and plain decoding (`plain_at(prompts, limits)`, stop tokens off) at that
    output's row lengths. Called after `spec` in each round: the adaptive controller picks k from timings, and k
    changes how the random draws fall, so a sampled run's lengths can differ from round to round."""
    latest: list[Rollout] = []

    def spec_run() -> Rollout:
        latest[:] = [spec()]
        return latest[0]

    def matched_run() -> Rollout:
        lengths = [len(t) for t in latest[0].tokens]  # rows in group order, as in_turn joins them
        ends = list(accumulate(map(len, groups)))
        out = in_turn([(group, lengths[end - len(group):end]) for group, end in zip(groups, ends, strict=True)],
                      lambda pair: plain_at(*pair))
        assert [len(t) for t in out.tokens] == lengths, "a length-matched row missed its spec run's length"
        return out

    return spec_run, matched_run


def speed_runs(policy: Transformer, draft: DraftModel, groups: list[list[list[int]]], k: int,
               max_new_tokens: int, stop_tokens: bool, verification: str = "block") -> dict[str, Callable[[], Rollout]]:
    """Plain (`ar_t*`), adaptive (`spec_t*`) and fixed-k (`fixed_t*`) decoding of the same prompts per temperature,
    and with stop tokens on at T > 0 plain decoding at the adaptive run's row lengths (`ar_matched_t*`)."""
    common = dict(max_new_tokens=max_new_tokens, stop_token_ids=None if stop_tokens else [], seed=0)
    runs = {}
    for t in EVAL_TEMPERATURES:
        controller = SpeculationController(k)
        runs[f"ar_t{t:g}"] = lambda t=t: in_turn(groups, lambda p: generate(policy, p, temperature=t, **common))
        runs[f"spec_t{t:g}"] = lambda t=t, c=controller: in_turn(groups, lambda p: generate(
            policy, p, drafter=draft.drafter(), num_speculative_tokens=k, temperature=t, adaptive=c,
            verification=verification, **common))
        runs[f"fixed_t{t:g}"] = lambda t=t: in_turn(groups, lambda p: generate(
            policy, p, drafter=draft.drafter(), num_speculative_tokens=k, temperature=t, adaptive=False,
            verification=verification, **common))
        if stop_tokens and t > 0:
            runs[f"spec_t{t:g}"], runs[f"ar_matched_t{t:g}"] = length_matched(
                groups, runs[f"spec_t{t:g}"], lambda p, limits, t=t: plain_at(policy, p, limits, temperature=t, seed=0))
    return runs


def past_stop_share(tokens: list[list[int]], stop_ids: Sequence[int]) -> float:
    """The share of `tokens` (rows decoded with stop tokens off) that come after each row's first stop token."""
    stops = set(stop_ids)
    ends = [next((i + 1 for i, t in enumerate(row) if t in stops), len(row)) for row in tokens]
    return sum(len(row) - end for row, end in zip(tokens, ends, strict=True)) / max(sum(map(len, tokens)), 1)


def draft_cost_share(spec: Rollout, ar: Rollout, per_token: bool) -> float:
    """The draft's seconds per proposal (per drafted position if `per_token`) / a plain decode step's seconds.

    Steady proposals only: those that first absorbed a backlog (the prompt) are prefill-like work, as the
    target's prefill is not a decode step either."""
    stats = spec.stats
    steady = stats.speculative_steps - stats.backlog_proposals
    if steady <= 0:
        return float("nan")
    decode_s = ar.stats.time_verify_s / max(ar.stats.target_forwards, 1)
    per_proposal = (stats.time_draft_s - stats.time_draft_backlog_s) / steady
    return per_proposal / (stats.drafts_per_step if per_token else 1) / decode_s


def prefill_recorded(runs: dict[str, Callable[[], Rollout]]
                     ) -> tuple[dict[str, Callable[[], Rollout]], dict[str, list[float]]]:
    """`runs`, each appending its output's prefill seconds to a list per run (one entry per call, warm-up first)."""
    prefill: dict[str, list[float]] = {name: [] for name in runs}

    def recorded(name: str, run: Callable[[], Rollout]) -> Rollout:
        out = run()
        prefill[name].append(out.stats.time_prefill_s)
        return out

    return {name: (lambda name=name, run=run: recorded(name, run)) for name, run in runs.items()}, prefill


def measure_speedup(policy: Transformer, draft: DraftModel, prompts: list[list[int]], *, batch: int, k: int,
                    max_new_tokens: int, repeats: int, stop_tokens: bool = False, verification: str = "block") -> dict:
    groups = prompt_groups(prompts, batch)
    runs, prefill = prefill_recorded(speed_runs(policy, draft, groups, k, max_new_tokens, stop_tokens, verification))
    times, outputs = interleaved(runs, repeats)
    prefill = {name: ps[1:] for name, ps in prefill.items()}  # the timed rounds' (the warm-up call is not timed)
    # the decode phase alone: each round's seconds less its prefill (the same work with and without a draft, and a
    # large share of a short generation at a large batch)
    decode_times = {name: [t - p for t, p in zip(ts, prefill[name], strict=True)] for name, ts in times.items()}
    # every repeat of a run emits the same tokens (seeded), except sampled adaptive runs, whose k (chosen from
    # timings) moves the random draws; with stop tokens on, sampled runs differ in length (tokens/s: last round's)
    tps = {name: outputs[name].stats.tokens_generated / median(ts) for name, ts in times.items()}
    result = {"batch": batch, "prompt_groups": len(groups), "times_s": times, "tokens_per_s": tps,
              "prefill_s": prefill,
              "greedy_tokens_identical": all(outputs[f"{v}_t0"].tokens == outputs["ar_t0"].tokens
                                             for v in ("spec", "fixed"))}
    for t in EVAL_TEMPERATURES:
        for variant in ("spec", "fixed"):
            run = outputs[f"{variant}_t{t:g}"]
            result[f"{variant}_speedup_t{t:g}"] = tps[f"{variant}_t{t:g}"] / tps[f"ar_t{t:g}"]
            result[f"{variant}_tau_t{t:g}"] = run.stats.acceptance_length
        result[f"spec_speedup_decode_t{t:g}"] = (
            outputs[f"spec_t{t:g}"].stats.tokens_generated / median(decode_times[f"spec_t{t:g}"])
            / (outputs[f"ar_t{t:g}"].stats.tokens_generated / median(decode_times[f"ar_t{t:g}"])))
        result[f"prefill_share_t{t:g}"] = median(prefill[f"ar_t{t:g}"]) / median(times[f"ar_t{t:g}"])
        if not stop_tokens:
            result[f"past_stop_share_t{t:g}"] = past_stop_share(outputs[f"ar_t{t:g}"].tokens, policy.args.eos_token_id)
        result[f"spec_k_histogram_t{t:g}"] = dict(sorted(Counter(outputs[f"spec_t{t:g}"].stats.k_chosen).items()))
        result[f"spec_drafted_per_step_t{t:g}"] = outputs[f"spec_t{t:g}"].stats.drafts_per_step
        result[f"draft_cost_share_t{t:g}"] = draft_cost_share(outputs[f"fixed_t{t:g}"], outputs[f"ar_t{t:g}"],
                                                             per_token=draft.family == "eagle3")
        matched = f"ar_matched_t{t:g}" in times  # each round's plain time at that round's adaptive lengths
        # per round, plain time / adaptive time of the same tokens: where the lengths are fixed (stop tokens off, or
        # greedy), the plain run's; else the length-matched run's. Their spread is the host's noise on one cell
        plain = times[f"ar_matched_t{t:g}" if matched else f"ar_t{t:g}"]
        result[f"spec_speedup_rounds_t{t:g}"] = [a / s for a, s in zip(plain, times[f"spec_t{t:g}"], strict=True)]
        if matched:
            result[f"spec_speedup_length_matched_t{t:g}"] = median(result[f"spec_speedup_rounds_t{t:g}"])
            result[f"length_matched_tokens_t{t:g}"] = {
                name: outputs[f"{name}_t{t:g}"].stats.tokens_generated for name in ("spec", "ar_matched")}
    log.info("batch %d: adaptive speedup %.2fx (t=0), %.2fx (t=1); fixed k %.2fx, %.2fx", batch,
             result["spec_speedup_t0"], result["spec_speedup_t1"], result["fixed_speedup_t0"],
             result["fixed_speedup_t1"])
    return result


def run_draft_bench(policy: Transformer, draft: DraftModel, prompts: list[list[int]], *, k: int,
                    batch_sizes: list[int], max_new_tokens: int, repeats: int, out_dir: str,
                    training: dict, stop_tokens: bool = False, verification: str = "block") -> dict:
    """`prompts` are held out from the draft's training; `training` says where the draft came from."""
    acceptance = measure_acceptance(policy, draft, prompts, k=k, max_new_tokens=max_new_tokens, seed=0,
                                    verification=verification)
    speed = [measure_speedup(policy, draft, prompts, batch=batch, k=k, max_new_tokens=max_new_tokens,
                             repeats=repeats, stop_tokens=stop_tokens, verification=verification)
             for batch in batch_sizes]
    payload = {"machine": machine(), "family": draft.family, "k": k, "max_new_tokens": max_new_tokens,
               "stop_tokens": stop_tokens, "verification": verification,
               "draft_matmuls": str(draft.inference_dtype).removeprefix("torch."),
               "repeats": repeats, "training": training, "acceptance": acceptance, "speedup": speed}
    write_results(out_dir, f"draft_{draft.family}", payload, tables(payload))
    return payload


def spread(values: list[float]) -> str:
    """`low-high` of a cell's per-round values (n/a without any)."""
    return f"{min(values):.3g}-{max(values):.3g}" if values else "n/a"


def tables(payload: dict) -> str:
    k, acceptance = payload["k"], payload["acceptance"]
    rows = [[f"{t:g}", k, acceptance[f"temperature_{t:g}"]["tau"],
             " ".join(f"{r:.2f}" for r in acceptance[f"temperature_{t:g}"]["accept_rate_per_position"])]
            for t in EVAL_TEMPERATURES]
    text = markdown_table(["temperature", "k", "tau", "acceptance per position"], rows)
    task, after = payload["training"].get("task", "arithmetic"), payload["training"].get("held_out_after")
    held = f" (after the first {after} of the task stream)" if after is not None else ""
    text += f"\n{payload['family']} draft (rollout matmuls {payload['draft_matmuls']}), " \
            f"{acceptance['prompts']} held-out {task} prompts{held}, " \
            f"{payload['max_new_tokens']} new tokens at most, sampled drafts judged by " \
            f"{payload.get('verification', 'token')} verification.\n\n"
    unit = "token" if payload["family"] == "eagle3" else "block"
    # n/a: no length-matched run (T = 0 or stop tokens off, where lengths already match), no past-EOS share (stops on)
    nan = float("nan")
    rows = [[r["batch"], f"{t:g}", r["tokens_per_s"][f"ar_t{t:g}"], r["tokens_per_s"][f"spec_t{t:g}"],
             r[f"spec_speedup_t{t:g}"], spread(r.get(f"spec_speedup_rounds_t{t:g}", [])),
             r.get(f"past_stop_share_t{t:g}", nan), r.get(f"prefill_share_t{t:g}", nan),
             r.get(f"spec_speedup_decode_t{t:g}", nan),
             r["tokens_per_s"].get(f"ar_matched_t{t:g}", nan),
             r.get(f"spec_speedup_length_matched_t{t:g}", nan), r[f"spec_tau_t{t:g}"],
             str(r[f"spec_k_histogram_t{t:g}"]), r.get(f"spec_drafted_per_step_t{t:g}", nan),
             r[f"fixed_speedup_t{t:g}"], r[f"fixed_tau_t{t:g}"],
             r[f"draft_cost_share_t{t:g}"],
             r["greedy_tokens_identical"]] for r in payload["speedup"] for t in EVAL_TEMPERATURES]
    text += markdown_table(["batch", "T", "AR tok/s", "adaptive tok/s", "adaptive speedup", "adaptive speedup, rounds",
                            "AR tokens past EOS", "prefill share of AR time", "adaptive speedup, decode only",
                            "length-matched AR tok/s", "adaptive speedup, length-matched", "adaptive tau",
                            "adaptive k used", "adaptive drafts per step", f"k={k} speedup", f"k={k} tau",
                            f"draft cost / decode step (per {unit})",
                            "greedy tokens identical"], rows)
    stops = "stop tokens on: rows end at EOS" if payload.get("stop_tokens") else "stop tokens off"
    text += f"\nAdaptive k (at most {k}) and fixed k = {k}, {payload['max_new_tokens']} new tokens per row at most " \
            f"({stops}), speedup = tokens/s ratio, medians of {payload['repeats']} interleaved repeats; each timed " \
            f"run decodes up to {SPEED_GROUPS} batches of distinct held-out prompts one after the other.\n" \
            "Decode only: the same with each round's prefill seconds taken out of its time (the prefill is the same " \
            "work with and without a draft); prefill share: the plain run's prefill seconds / its time, medians.\n" \
            "Rounds: the lowest and highest of the rounds' plain time / adaptive time (the same tokens per row; " \
            "with stop tokens on at T > 0 the length-matched run's), the spread of one cell on this host.\n" \
            "Adaptive k used: the most each step could draft; drafts per step: what its steps drafted on average " \
            "(a chain draft ends a proposal early where its calibrated confidence no longer pays).\n"
    if payload.get("stop_tokens"):
        text += "Length-matched (T > 0): plain decoding with stop tokens off and each row limited to the length the " \
                "adaptive run gave it in the same round; its speedup is the median over rounds of that run's time / " \
                "the adaptive run's time, both decoding the same number of tokens per row.\n"
    else:
        text += "AR tokens past EOS: the share of plain decoding's tokens after each row's first stop token (text " \
                "a rollout would not have produced, which a draft distilled from rollouts never saw).\n"
    return text
