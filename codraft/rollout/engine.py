"""Batched generation: plain decoding or lossless speculative decoding.

Row state lives in tensors (pending token, tokens out so far, the target's KV
cache with per-row lengths), so one step is the same few tensor ops for every
row; Python touches single rows only when they finish and leave the batch.
Each step feeds [pending, d_1..d_k] per row to the target in one forward,
verifies (verify.py), keeps the pending token and the accepted drafts in the
cache and makes the correction/bonus token the next pending one.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from codraft.models import KVCache, Transformer
from codraft.rollout.adaptive import SpeculationController
from codraft.rollout.drafter import Drafter, Proposal
from codraft.rollout.sampling import SamplingParams, draw, probabilities
from codraft.rollout.stats import RolloutStats
from codraft.rollout.verify import verify

log = logging.getLogger(__name__)


@dataclass
class Rollout:
    prompts: list[list[int]]
    tokens: list[list[int]]  # generated ids per row (a stop token, if hit, is the last one)
    logprobs: list[list[float]]  # log p(token) under the target distribution it was drawn from
    finish_reasons: list[str]  # "stop" | "length"
    stats: RolloutStats


def _check_prompts(prompts: list[list[int]], vocab_size: int, max_context: int, extra: int) -> None:
    if not prompts:
        raise ValueError("prompts is empty; pass at least one list of token ids")
    for i, p in enumerate(prompts):
        if len(p) == 0:
            raise ValueError(f"prompts[{i}] is empty; every prompt needs at least one token")
        if min(p) < 0 or max(p) >= vocab_size:
            raise ValueError(f"prompts[{i}] has token ids outside [0, {vocab_size})")
        if len(p) + extra > max_context:
            raise ValueError(
                f"prompts[{i}] has {len(p)} tokens; with max_new_tokens and speculation it needs {len(p) + extra} "
                f"positions but the model's context is {max_context}"
            )


def _usable(proposal: Proposal, rows: int, k: int, vocab_size: int) -> str | None:
    """Why a proposal cannot be verified (None if it can). A bad draft may only cost speed."""
    tokens, lengths, probs = proposal.tokens, proposal.lengths, proposal.probs
    if tokens.dim() != 2 or tokens.shape[0] != rows or lengths.shape != (rows,):
        return f"tokens {tuple(tokens.shape)} / lengths {tuple(lengths.shape)} do not fit {rows} rows"
    if bool((lengths < 0).any()) or bool((lengths > min(k, tokens.shape[1])).any()):
        return f"lengths outside [0, {k}]"
    valid = torch.arange(tokens.shape[1], device=tokens.device) < lengths[:, None]
    if bool(((tokens < 0) | (tokens >= vocab_size))[valid].any()):
        return f"token ids outside [0, {vocab_size})"
    if probs is not None:
        if probs.shape != (*tokens.shape, vocab_size):
            return f"probs {tuple(probs.shape)} do not match tokens {tuple(tokens.shape)} x vocab {vocab_size}"
        probs = probs[valid]
        if not bool(torch.isfinite(probs).all()) or bool((probs < 0).any()):
            return "probs are negative or not finite"
        if bool(((probs.sum(-1) - 1).abs() > 1e-3).any()):
            return "probs do not sum to 1"
        if bool((probs.gather(-1, tokens[valid][:, None]) <= 0).any()):
            return "a proposed token has zero draft probability"
    return None


@torch.no_grad()
def generate(
    model: Transformer,
    prompts: list[list[int]],
    *,
    drafter: Drafter | None = None,
    num_speculative_tokens: int = 4,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = 0,
    max_new_tokens: int = 128,
    stop_token_ids: list[int] | None = None,
    seed: int | None = None,
    adaptive: bool | SpeculationController = False,
) -> Rollout:
    """Generate a continuation of every prompt; rows finish independently.

    With a drafter, up to `num_speculative_tokens` drafts per row are verified per
    target forward; the output distribution is the target's either way. `adaptive`
    (True or a controller kept across calls) picks k per step and may turn
    speculation off when it does not pay.
    """
    params = SamplingParams(temperature, top_p, top_k)
    if num_speculative_tokens < 0:
        raise ValueError(f"num_speculative_tokens must be >= 0, got {num_speculative_tokens}")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    args = model.args
    k_max = num_speculative_tokens if drafter is not None else 0
    _check_prompts(prompts, args.vocab_size, args.max_position_embeddings, max_new_tokens + k_max + 1)
    stop_ids = torch.tensor(args.eos_token_id if stop_token_ids is None else list(stop_token_ids), dtype=torch.long)
    controller = adaptive if isinstance(adaptive, SpeculationController) else None
    if adaptive is True and k_max:
        controller = SpeculationController(k_max)

    device = next(model.parameters()).device
    generator = torch.Generator(device).manual_seed(seed) if seed is not None else None
    stats = RolloutStats(rows=len(prompts))
    taps = drafter.tap_layers if drafter is not None else ()
    start = time.perf_counter()

    # prefill: right-padded prompts; pad positions write keys no query will see
    B = len(prompts)
    prompt_lens = torch.tensor([len(p) for p in prompts], device=device)
    ids = torch.zeros(B, int(prompt_lens.max()), dtype=torch.long, device=device)
    for i, p in enumerate(prompts):
        ids[i, : len(p)] = torch.tensor(p)
    cache = model.new_cache(B, ids.shape[1] + max_new_tokens + k_max + 1)
    out = model(ids, cache=cache, taps=taps, compute_logits=False)
    cache.lengths.copy_(prompt_lens)
    pending, first_logprob = draw(model.logits(out.hidden[torch.arange(B), prompt_lens - 1]), params, generator)
    if drafter is not None:
        drafter.start(prompts, out.taps, params, cache.max_len, generator)
    stats.time_prefill_s = time.perf_counter() - start

    width = max_new_tokens + k_max + 1
    tokens = torch.zeros(B, width, dtype=torch.long, device=device)
    logprobs = torch.zeros(B, width, device=device)
    tokens[:, 0] = pending
    logprobs[:, 0] = first_logprob
    n_out = torch.ones(B, dtype=torch.long, device=device)
    rows = torch.arange(B, device=device)  # original index of each live row
    results: list[tuple[list[int], list[float], str] | None] = [None] * B

    def retire(done: torch.Tensor, reason: torch.Tensor) -> None:
        nonlocal tokens, logprobs, n_out, pending, rows
        for i in done.nonzero().flatten().tolist():
            n = int(n_out[i])
            results[int(rows[i])] = (
                tokens[i, :n].tolist(),
                logprobs[i, :n].tolist(),
                "stop" if reason[i] else "length",
            )
        keep = (~done).nonzero().flatten()
        tokens, logprobs, n_out, pending, rows = tokens[keep], logprobs[keep], n_out[keep], pending[keep], rows[keep]
        cache.keep_rows(keep)
        if drafter is not None:
            drafter.keep_rows(keep)

    hit_stop = torch.isin(pending, stop_ids)
    done = hit_stop | (n_out >= max_new_tokens)
    if bool(done.any()):
        retire(done, hit_stop)

    if controller is not None and rows.numel():
        _calibrate(model, cache, controller, rows.numel(), k_max)

    while rows.numel():
        live = rows.numel()
        k = controller.choose(live) if controller is not None else k_max
        proposal, t_draft = None, time.perf_counter()
        if k:
            proposal = drafter.propose(pending, k)
            problem = _usable(proposal, live, k, args.vocab_size)
            if problem is not None:
                log.warning("drafter proposal rejected (%s); decoding this step without speculation", problem)
                stats.malformed_proposals += 1
                proposal, k = None, 0
            else:
                k = min(k, proposal.tokens.shape[1])  # a drafter may propose fewer (a DFlash block holds b-1)
        t_verify = time.perf_counter()
        stats.time_draft_s += t_verify - t_draft

        if proposal is not None:
            budget = max_new_tokens - n_out - 1  # the step also emits one target token
            num_drafts = proposal.lengths.clamp(max=budget).clamp(min=0)
            drafts = proposal.tokens[:, :k]
            feed = torch.cat([pending[:, None], drafts], dim=1)
        else:
            feed = pending[:, None]
        fwd = model(feed, cache=cache, taps=taps)
        if proposal is not None:
            target = probabilities(fwd.logits, params)  # [B, k+1, V]
            draft_probs = proposal.probs[:, :k] if proposal.probs is not None else None
            verdict = verify(drafts, num_drafts, draft_probs, target, generator)
            accepted, nxt = verdict.num_accepted, verdict.next_token
            emitted = torch.cat([drafts, nxt[:, None]], dim=1)
            emitted[torch.arange(live, device=device), accepted] = nxt
            emitted_logprobs = target.gather(-1, emitted[..., None]).squeeze(-1).log()
        else:
            accepted = torch.zeros(live, dtype=torch.long, device=device)
            nxt, nxt_logprob = draw(fwd.logits[:, 0], params, generator)
            emitted, emitted_logprobs = nxt[:, None], nxt_logprob[:, None]
        # positions past `accepted` hold junk that later steps overwrite
        cols = n_out[:, None] + torch.arange(k + 1, device=device)
        tokens.scatter_(1, cols, emitted)
        logprobs.scatter_(1, cols, emitted_logprobs)
        cache.advance(accepted + 1)
        if drafter is not None:
            drafter.commit(feed, accepted + 1, fwd.taps)
        pending = nxt
        stats.time_verify_s += time.perf_counter() - t_verify

        # stop tokens among the emitted ones end the row right after the first of them
        in_step = torch.arange(k + 1, device=device)[None] <= accepted[:, None]
        stop_hit = torch.isin(emitted, stop_ids) & in_step
        hit = stop_hit.any(-1)
        emitted_count = torch.where(hit, stop_hit.long().argmax(-1) + 1, accepted + 1)
        n_out += emitted_count
        _count_step(
            stats,
            controller,
            k,
            live,
            accepted,
            emitted_count,
            num_drafts if k else None,
            time.perf_counter() - t_verify,
            t_verify - t_draft,
        )
        done = hit | (n_out >= max_new_tokens)
        if bool(done.any()):
            retire(done, hit)

    stats.time_total_s = time.perf_counter() - start
    stats.tokens_generated = sum(len(r[0]) for r in results)
    return Rollout(
        prompts=[list(p) for p in prompts],
        tokens=[r[0] for r in results],
        logprobs=[r[1] for r in results],
        finish_reasons=[r[2] for r in results],
        stats=stats,
    )


def _count_step(
    stats: RolloutStats,
    controller: SpeculationController | None,
    k: int,
    live: int,
    accepted: torch.Tensor,
    emitted: torch.Tensor,
    num_drafts: torch.Tensor | None,
    verify_s: float,
    draft_s: float,
) -> None:
    stats.target_forwards += 1
    stats.row_verifies += live
    stats.tokens_from_verifies += int(emitted.sum())
    if controller is not None:  # plain decoding would need emitted/live forwards of `live` rows
        stats.ar_time_estimate_s += controller.cost(live) * float(emitted.sum()) / live
    stats.k_chosen.append(k)
    if not k:
        if controller is not None:
            controller.observe(0, [], [], live, verify_s, draft_s)
        return
    positions = torch.arange(k, device=accepted.device)
    proposed = (num_drafts[:, None] > positions).sum(0).tolist()
    accepted_at = (accepted[:, None] > positions).sum(0).tolist()
    stats.count_positions(proposed, accepted_at)
    stats.draft_tokens_proposed += int(num_drafts.sum())
    stats.draft_tokens_accepted += int(accepted.sum())
    if controller is not None:
        reached = (accepted[:, None] >= positions).sum(0).tolist()
        controller.observe(k, reached, accepted_at, live, verify_s, draft_s)


def _calibrate(model: Transformer, cache: KVCache, controller: SpeculationController, rows: int, k_max: int) -> None:
    """Time real forwards on the live cache (lengths untouched, so nothing is kept)."""

    def forward(n_rows: int, n_tokens: int) -> None:
        sub = cache if n_rows == cache.batch_size else _row_view(cache, n_rows)
        model(torch.zeros(n_rows, n_tokens, dtype=torch.long, device=cache.lengths.device), cache=sub)

    controller.cost.calibrate(forward, 1, k_max + 1)
    controller.cost.calibrate(forward, rows, k_max + 1)


def _row_view(cache: KVCache, n_rows: int) -> KVCache:
    view = object.__new__(KVCache)
    view.k, view.v, view.lengths, view.max_len = (
        cache.k[:, :n_rows],
        cache.v[:, :n_rows],
        cache.lengths[:n_rows],
        cache.max_len,
    )
    return view
