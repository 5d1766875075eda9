"""Batched generation: plain decoding or lossless speculative decoding.

Row state lives in tensors (pending token, tokens out so far, the target's KV
cache with per-row lengths), so one step is the same few tensor ops for every
row; Python touches single rows only when they finish and leave the batch.
Each step feeds [pending, d_1..d_n] per row (n <= k, the controller may cut a row's drafts, and
the forward then runs only the tokens fed) to the target in one forward,
verifies (verify.py), keeps the pending token and the accepted drafts in the
cache and makes the correction/bonus token the next pending one.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch
from torch import nn

from codraft.models import KVCache, Transformer
from codraft.models.linear import pack_linears, unpack_linears
from codraft.rollout.adaptive import SpeculationController
from codraft.rollout.drafter import Drafter, Proposal, right_padded
from codraft.rollout.sampling import SamplingParams, draw, greedy_tokens, probabilities
from codraft.rollout.stats import RolloutStats
from codraft.rollout.verify import check_rule, verify, verify_greedy, vocab_index

log = logging.getLogger(__name__)


@dataclass
class Rollout:
    prompts: list[list[int]]
    tokens: list[list[int]]  # generated ids per row (a stop token, if hit, is the last one)
    logprobs: list[list[float]]  # log p(token) under the target distribution it was drawn from
    finish_reasons: list[str]  # "stop" | "length"
    stats: RolloutStats


def _row_limits(max_new_tokens: int | list[int], rows: int) -> list[int]:
    """One new-token limit per row: an int for all of them, or a list with one per prompt."""
    if isinstance(max_new_tokens, int):
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        return [max_new_tokens] * rows
    limits = list(max_new_tokens)
    if len(limits) != rows:
        raise ValueError(f"max_new_tokens has {len(limits)} limits for {rows} prompts; pass an int or one per prompt")
    for i, n in enumerate(limits):
        if n < 1:
            raise ValueError(f"max_new_tokens[{i}] must be >= 1, got {n}")
    return limits


def _check_prompts(prompts: list[list[int]], vocab_size: int, max_context: int, extras: list[int]) -> None:
    if not prompts:
        raise ValueError("prompts is empty; pass at least one list of token ids")
    for i, (p, extra) in enumerate(zip(prompts, extras, strict=True)):
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
    """Why a proposal cannot be verified (None if it can). A bad draft may only cost speed.

    Shapes are checked in Python; the values with a few reductions and one device sync, reading the
    probabilities once for their row sums and once for their minimum."""
    tokens, lengths, probs, vocab = proposal.tokens, proposal.lengths, proposal.probs, proposal.vocab
    if tokens.dim() != 2 or tokens.shape[0] != rows or lengths.shape != (rows,):
        return f"tokens {tuple(tokens.shape)} / lengths {tuple(lengths.shape)} do not fit {rows} rows"
    confidence = proposal.confidence
    if confidence is not None and confidence.shape != tokens.shape:
        return f"confidence {tuple(confidence.shape)} does not match tokens {tuple(tokens.shape)}"
    width = vocab_size if vocab is None else vocab.numel()
    if probs is not None and probs.shape != (*tokens.shape, width):
        return f"probs {tuple(probs.shape)} do not match tokens {tuple(tokens.shape)} x vocab {width}"
    if vocab is not None and (vocab.dim() != 1 or not 0 < vocab.numel() <= vocab_size):
        return f"vocab {tuple(vocab.shape)} is not a list of at most {vocab_size} target ids"
    valid = torch.arange(tokens.shape[1], device=tokens.device) < lengths[:, None]
    checks = [((lengths < 0) | (lengths > min(k, tokens.shape[1]))).any(),
              ((tokens < 0) | (tokens >= vocab_size))[valid].any(),
              ~((confidence >= 0) & (confidence <= 1))[valid].all() if confidence is not None
              else tokens.new_zeros((), dtype=torch.bool)]
    if probs is not None:
        index = vocab_index(tokens.clamp(0, vocab_size - 1), vocab)
        q = probs.gather(-1, index[..., None]).squeeze(-1)[valid]
        off_vocab = (vocab[index] != tokens)[valid].any() if vocab is not None else q.new_zeros((), dtype=torch.bool)
        sums, low = probs.sum(-1)[valid], probs.amin(-1)[valid]
        checks += [~torch.isfinite(sums).all() | (low < 0).any(), ((sums - 1).abs() > 1e-3).any(),
                   off_vocab | (q <= 0).any()]
    failed = torch.stack(checks).tolist()
    reasons = [f"lengths outside [0, {k}]", f"token ids outside [0, {vocab_size})", "confidence outside [0, 1]",
               "probs are negative or not finite",
               "probs do not sum to 1", "a proposed token has zero draft probability"]
    return next((why for why, bad in zip(reasons, failed, strict=False) if bad), None)


def compaction(done: torch.Tensor) -> torch.Tensor:
    """The rows that go on (done [B] is False), ordered so that those already among the first n (n of them go on)
    keep their places and each finished row there takes one from past n."""
    n = int((~done).sum())
    keep = torch.arange(n, device=done.device)
    holes = done[:n].nonzero().flatten()
    keep[holes] = (~done[n:]).nonzero().flatten() + n
    return keep


def _prefill(model: Transformer, prompts: list[list[int]], room: int, taps: tuple[int, ...]
             ) -> tuple[KVCache, torch.Tensor, dict[int, torch.Tensor]]:
    """The prompts' KV cache (with `room` free positions after the longest), each row's hidden state at its last
    prompt token [B, H] and the prompts' taps.

    Each distinct prompt runs once and its rows copy the result: a GRPO group repeats its prompt group_size
    times, and a 4-row group's prefill took 0.6-1.1 s of a 5-10 s chain-task rollout. Prompts are right-padded;
    pad positions write keys no query will see."""
    device = next(model.parameters()).device
    index: dict[tuple[int, ...], int] = {}
    rows = torch.tensor([index.setdefault(tuple(p), len(index)) for p in prompts], device=device)
    ids, lengths = right_padded(list(index), device)  # the distinct prompts, in order of their index
    cache = model.new_cache(len(index), ids.shape[1] + room)
    out = model(ids, cache=cache, taps=taps, compute_logits=False)
    cache.lengths.copy_(lengths)
    last = out.hidden[torch.arange(len(index), device=device), lengths - 1]
    if len(index) == len(prompts):
        return cache, last, out.taps
    cache.keep_rows(rows)
    return cache, last[rows], {layer: t[rows] for layer, t in out.taps.items()}


# inference_mode, not no_grad: no version counters or view tracking on the step's many small tensors; a plain
# decode step took 0.91x (batch 1) and 0.94x (batch 8) of its no_grad time, in an in-process A/B
@torch.inference_mode()
def generate(
    model: Transformer,
    prompts: list[list[int]],
    *,
    drafter: Drafter | None = None,
    num_speculative_tokens: int = 4,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = 0,
    max_new_tokens: int | list[int] = 128,
    stop_token_ids: list[int] | None = None,
    seed: int | None = None,
    adaptive: bool | SpeculationController = False,
    packed_weights: bool = True,
    verification: str = "block",
) -> Rollout:
    """Generate a continuation of every prompt; rows finish independently.

    With a drafter, up to `num_speculative_tokens` drafts per row are verified per
    target forward; the output distribution is the target's either way. `adaptive`
    (True or a controller kept across calls) picks k per step and may turn
    speculation off when it does not pay. `packed_weights` runs the target's and
    the draft's linears on packed copies (models/linear.py: oneDNN's, or fbgemm's for a draft's int8), in
    `model.inference_dtype` and the drafter's `model_dtype`; False is the plain F.linear reference path at the
    weights' precision. `max_new_tokens` is one limit for every row or a list with one per prompt (`codraft bench
    draft` decodes plainly at the lengths a speculative run produced). `verification`: how sampled (T > 0) calls
    judge a chain of drafts, "block" (each prefix as a whole) or "token" (each draft on its own); both are lossless,
    and block keeps at least as many drafts on average (verify.py). Greedy calls compare argmaxes either way.
    """
    params = SamplingParams(temperature, top_p, top_k)
    check_rule(verification)
    if num_speculative_tokens < 0:
        raise ValueError(f"num_speculative_tokens must be >= 0, got {num_speculative_tokens}")
    row_limits = _row_limits(max_new_tokens, len(prompts))
    args = model.args
    k_max = num_speculative_tokens if drafter is not None else 0
    _check_prompts(prompts, args.vocab_size, args.max_position_embeddings, [n + k_max + 1 for n in row_limits])
    stop_ids = torch.tensor(args.eos_token_id if stop_token_ids is None else list(stop_token_ids), dtype=torch.long)
    controller = adaptive if isinstance(adaptive, SpeculationController) else None
    # a greedy draft's confidence in its argmax says well whether the target's argmax agrees; a sampled token's
    # does not say whether p/q passes (at T=1 drafts below 2% cumulative confidence were accepted 11% of the time),
    # so only greedy calls end proposals early
    stops_early = drafter is not None and drafter.stops_early and params.greedy
    if adaptive is True and k_max:
        controller = SpeculationController(k_max)
    if controller is not None:
        controller.new_batch(len(prompts), stops_early=stops_early)

    device = next(model.parameters()).device
    generator = torch.Generator(device).manual_seed(seed) if seed is not None else None
    stats = RolloutStats(rows=len(prompts))
    taps = drafter.tap_layers if drafter is not None else ()

    def refresh(module: nn.Module, dtype: torch.dtype | None) -> None:
        # a no-op unless the weights (or the dtype asked for) changed since the last call
        pack_linears(module, dtype=dtype) if packed_weights else unpack_linears(module)

    start = time.perf_counter()
    refresh(model, model.inference_dtype)
    stats.time_pack_policy_s = time.perf_counter() - start  # a plain rollout pays this too (rollout/speedup.py)
    if drafter is not None and drafter.model is not None:
        refresh(drafter.model, drafter.model_dtype)
    stats.time_pack_s = time.perf_counter() - start

    B = len(prompts)
    most = max(row_limits)
    cache, last_hidden, prompt_taps = _prefill(model, prompts, most + k_max + 1, taps)
    pending, first_logprob = draw(model.logits(last_hidden), params, generator)
    if drafter is not None:
        drafter.start(prompts, prompt_taps, params, cache.max_len, generator)
    stats.time_prefill_s = time.perf_counter() - start

    width = most + k_max + 1
    tokens = torch.zeros(B, width, dtype=torch.long, device=device)
    logprobs = torch.zeros(B, width, device=device)
    tokens[:, 0] = pending
    logprobs[:, 0] = first_logprob
    n_out = torch.ones(B, dtype=torch.long, device=device)
    limit = torch.tensor(row_limits, device=device)  # each live row's own new-token limit
    rows = torch.arange(B, device=device)  # original index of each live row
    results: list[tuple[list[int], list[float], str] | None] = [None] * B

    def retire(done: torch.Tensor, reason: torch.Tensor) -> None:
        nonlocal tokens, logprobs, n_out, limit, pending, rows
        for i in done.nonzero().flatten().tolist():
            n = int(n_out[i])
            results[int(rows[i])] = (
                tokens[i, :n].tolist(),
                logprobs[i, :n].tolist(),
                "stop" if reason[i] else "length",
            )
        keep = compaction(done)  # finished rows' slots refilled from the end: the caches copy only those rows
        tokens, logprobs, n_out, limit = tokens[keep], logprobs[keep], n_out[keep], limit[keep]
        pending, rows = pending[keep], rows[keep]
        cache.keep_rows(keep)
        if drafter is not None:
            drafter.keep_rows(keep)
        if controller is not None:
            controller.keep_rows(keep)

    hit_stop = torch.isin(pending, stop_ids)
    done = hit_stop | (n_out >= limit)
    if bool(done.any()):
        retire(done, hit_stop)

    steps = torch.arange(k_max + 1, device=device)  # a step's token slots: the pending token, then the drafts
    caught_up = False  # the drafter absorbed everything up to the last step (False: the prompt is pending)
    while rows.numel():
        live = rows.numel()
        if controller is None:
            k = k_max
        else:  # the batch ends with its last row: with no stop tokens, each row's length is known (`tail`)
            k = controller.choose(live, (limit - n_out).tolist() if not stop_ids.numel() else None)
        probing = k > 0 and controller is not None and controller.probing
        # a probe drafts on its first probe_rows rows: its time is not a whole batch's, and the others' backlog
        # waits for the next proposal
        sampled_all = controller is None or controller.samples_all(live)
        proposal, t_draft = None, time.perf_counter()
        if k:
            stop = {"stop": controller.stop_rule(live, k)} if controller is not None and stops_early else {}
            proposal = drafter.propose(pending, k, probe_rows=controller.probe_rows if probing else None, **stop)
            problem = _usable(proposal, live, k, args.vocab_size)
            if problem is not None:
                log.warning("drafter proposal rejected (%s); decoding this step without speculation", problem)
                stats.malformed_proposals += 1
                proposal, k = None, 0
            # k stays the most the step could draft: a drafter may propose fewer (a DFlash block holds b-1, a chain
            # stops early), and the controller learns what a step of k yields with that counted as rejected
            stats.draft_positions += proposal.tokens.shape[1] if proposal is not None else 0
        t_verify = time.perf_counter()
        stats.time_draft_s += t_verify - t_draft
        if k and not caught_up:
            stats.time_draft_backlog_s += t_verify - t_draft
            stats.backlog_proposals += 1

        width, active = 0, None  # drafts fed per row; the tokens the forward runs (None: all fed)
        if proposal is not None:
            confidence = proposal.confidence[:, :k] if proposal.confidence is not None else None
            budget = limit - n_out - 1  # the step also emits one target token
            num_drafts = proposal.lengths.clamp(max=budget).clamp(min=0)
            if controller is not None:
                # a sampled draft's cut may not read its own probability: keeping d_i only where q_i(d_i) is high
                # proposes another distribution than q_i, and the output leaves the target's (test_block_verify)
                num_drafts = controller.verify_lengths(live, k, num_drafts, confidence if params.greedy else None)
            width = int(num_drafts.max())
            drafts = proposal.tokens[:, :width]
            feed = torch.cat([pending[:, None], drafts], dim=1)
            fed = steps[: width + 1] <= num_drafts[:, None]  # a prefix of each row
            if not bool(fed.all()):  # rows with fewer drafts than others pay only for their own tokens
                active = fed.flatten().nonzero().squeeze(1)
        else:
            feed = pending[:, None]
        fwd = model(feed, cache=cache, taps=taps, active=active)
        if proposal is not None:
            if params.greedy:  # argmax ids only; greedy log-probs are 0 (point masses)
                verdict = verify_greedy(drafts, num_drafts, greedy_tokens(fwd.logits))
            else:
                target = probabilities(fwd.logits, params)  # [B, width+1, V]
                draft_probs = proposal.probs[:, :width] if proposal.probs is not None else None
                verdict = verify(drafts, num_drafts, draft_probs, proposal.vocab, target, generator, verification)
            accepted, nxt = verdict.num_accepted, verdict.next_token
            emitted = torch.cat([drafts, nxt[:, None]], dim=1)
            emitted[torch.arange(live, device=device), accepted] = nxt
            if params.greedy:
                emitted_logprobs = torch.zeros(emitted.shape, device=device)
            else:
                emitted_logprobs = target.gather(-1, emitted[..., None]).squeeze(-1).log()
            if controller is not None and confidence is not None:
                controller.observe_drafts(confidence, num_drafts, accepted)
        else:
            accepted = torch.zeros(live, dtype=torch.long, device=device)
            nxt, nxt_logprob = draw(fwd.logits[:, 0], params, generator)
            emitted, emitted_logprobs = nxt[:, None], nxt_logprob[:, None]
        # positions past `accepted` hold junk that later steps overwrite
        cols = n_out[:, None] + steps[: width + 1]
        tokens.scatter_(1, cols, emitted)
        logprobs.scatter_(1, cols, emitted_logprobs)
        cache.advance(accepted + 1)
        if drafter is not None:
            drafter.commit(feed, accepted + 1, fwd.taps)
        pending = nxt
        stats.time_verify_s += time.perf_counter() - t_verify

        # stop tokens among the emitted ones end the row right after the first of them
        in_step = steps[None, : width + 1] <= accepted[:, None]
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
            t_verify - t_draft if caught_up and sampled_all else None,
            live * (width + 1) if active is None else active.numel(),
        )
        if probing:
            controller.observe_probe(live, time.perf_counter() - t_draft)
        caught_up = k > 0 and sampled_all
        done = hit | (n_out >= limit)
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
    draft_s: float | None,
    fed: int,
) -> None:
    stats.target_forwards += 1
    stats.row_verifies += live
    stats.tokens_from_verifies += int(emitted.sum())
    stats.k_chosen.append(k)
    if not k:
        if controller is not None:
            controller.observe(0, [], [], live, verify_s, draft_s, fed)
        return
    positions = torch.arange(k, device=accepted.device)
    proposed = (num_drafts[:, None] > positions).sum(0).tolist()
    accepted_at = (accepted[:, None] > positions).sum(0).tolist()
    stats.count_positions(proposed, accepted_at)
    stats.draft_tokens_proposed += int(num_drafts.sum())
    stats.draft_tokens_accepted += int(accepted.sum())
    if controller is not None:
        # a draft cut off by the row's length limit or the controller's truncation, or never proposed, counts as
        # reached and not accepted (it yields no token); a probe's rows past probe_rows were not sampled at all
        reached_at = accepted[:, None] >= positions
        if controller.probing:
            reached_at[controller.probe_rows:] = False
        reached = reached_at.sum(0).tolist()
        controller.observe_rows(k, num_drafts > 0, accepted)
        controller.observe(k, reached, accepted_at, live, verify_s, draft_s, fed)
