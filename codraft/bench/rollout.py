"""`codraft bench rollout`: codraft's engine against transformers' generate, side by side.

Per batch size, interleaved repeats (medians reported) of:
  codraft plain decoding          vs  transformers greedy generate
  codraft n-gram speculative (fixed k, and adaptive k)
  codraft with an untrained EAGLE-3 draft and adaptive k (a fresh controller every call, so what it costs
  to find out that the draft is useless is in the time; goal: at most 1.05x plain decoding)
  transformers assisted generation with the same drafter (prompt lookup; batch 1 only,
  transformers does not batch it)
All runs are greedy with stop tokens off, so every system produces the same number of tokens
and codraft's outputs can be checked against transformers'. (transformers is told to stop on no
token, eos_token_id=-1, rather than given min_new_tokens, which would mask EOS and change the text.)
Decode time per step is set against the memory-bandwidth floor: (bytes of weights + KV cache read per step) / bandwidth.
Verify cost: a forward of t tokens per row over the cache, relative to a 1-token decode step at the same batch,
with the packed weights the engine uses (codraft's fp32 kernel or oneDNN's) and with plain F.linear
(models/linear.py), interleaved.
"""

from __future__ import annotations

import logging
import random
from collections import Counter

import torch

from codraft.bench.report import interleaved, machine, markdown_table, median, read_bandwidth_gbs, write_results
from codraft.config import DraftConfig
from codraft.drafts import build_draft
from codraft.models import Tokenizer, Transformer
from codraft.models.linear import pack_linears, packed_kernels, packed_weight_bytes, unpack_linears
from codraft.rollout import SpeculationController, generate
from codraft.rollout.drafters import NgramDrafter

VERIFY_TOKENS = (2, 4, 8)

log = logging.getLogger(__name__)

SENTENCES = [
    "The quick brown fox jumps over the lazy dog near the river bank.",
    "Speculative decoding lets a small draft propose tokens that a large model verifies in parallel.",
    "In reinforcement learning the policy generates many answers, which are scored and used for an update.",
    "A key-value cache stores the attention keys and values of every token that has been processed.",
]


def bench_prompts(tokenizer: Tokenizer, n: int, seed: int = 0) -> list[list[int]]:
    """Half copy-and-explain prompts (where prompt lookup can help), half arithmetic."""
    rng = random.Random(seed)
    texts = []
    for i in range(n):
        if i % 2 == 0:
            texts.append(f"Repeat this sentence exactly, then explain it: {SENTENCES[(i // 2) % len(SENTENCES)]}")
        else:
            texts.append(f"What is {rng.randint(10, 99)} + {rng.randint(10, 99)}? Show your work step by step.")
    rendered = [tokenizer.apply_chat_template([{"role": "user", "content": t}]) for t in texts]
    return [tokenizer.encode(r, add_special_tokens=False) for r in rendered]


def _hf_generate(hf, prompts: list[list[int]], pad_id: int, n: int, **kwargs) -> list[list[int]]:
    width = max(map(len, prompts))
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])  # left padding
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.no_grad():
        out = hf.generate(ids, attention_mask=mask, max_new_tokens=n, do_sample=False, eos_token_id=-1,
                          pad_token_id=pad_id, **kwargs)
    return out[:, width:].tolist()


@torch.no_grad()
def verify_cost_ratios(model: Transformer, batch: int, context: int, repeats: int) -> dict[str, dict[int, float]]:
    """Seconds of a t-token forward per row over a `context`-long cache / a 1-token one, with plain F.linear and
    with packed weights in the model's `inference_dtype` (shapes interleaved within each; packing happens outside
    the timed calls)."""
    cache = model.new_cache(batch, context + max(VERIFY_TOKENS))
    cache.lengths.fill_(context)
    ratios = {}
    for name, prepare in (("plain", unpack_linears), ("packed", lambda m: pack_linears(m, dtype=m.inference_dtype))):
        prepare(model)
        runs = {t: (lambda t=t: model(torch.zeros(batch, t, dtype=torch.long), cache=cache))
                for t in (1, *VERIFY_TOKENS)}
        times, _ = interleaved(runs, 3 * repeats)
        ratios[name] = {t: median(times[t]) / median(times[1]) for t in VERIFY_TOKENS}
    return ratios


def run_rollout_bench(model: Transformer, tokenizer: Tokenizer, hf, *, batch_sizes: list[int], max_new_tokens: int,
                      repeats: int, k: int, out_dir: str) -> dict:
    bandwidth = read_bandwidth_gbs()
    pack_linears(model, dtype=model.inference_dtype)
    weight_bytes = packed_weight_bytes(model)  # what a decode step reads: bf16 copies where the rollout runs them
    kernels = packed_kernels(model)
    matmul_dtype = str(model.inference_dtype or next(model.parameters()).dtype).removeprefix("torch.")
    args = model.args
    pad_id = tokenizer.eos_token_ids[0]
    untrained = build_draft(DraftConfig(family="eagle3"), model, tokenizer).eval()
    plain = dict(temperature=0, max_new_tokens=max_new_tokens, stop_token_ids=[])
    rows, cost_rows, results = [], [], []
    for batch in batch_sizes:
        prompts = bench_prompts(tokenizer, batch)
        controller = SpeculationController(k)  # kept across repeats, as the trainer keeps it across steps
        runs = {
            "codraft_ar": lambda p=prompts: generate(model, p, **plain),
            "hf_generate": lambda p=prompts: _hf_generate(hf, p, pad_id, max_new_tokens),
            "codraft_ngram": lambda p=prompts: generate(model, p, drafter=NgramDrafter(), num_speculative_tokens=k,
                                                        **plain),
            "codraft_ngram_adaptive": lambda p=prompts, c=controller: generate(
                model, p, drafter=NgramDrafter(), num_speculative_tokens=k, adaptive=c, **plain),
            "codraft_untrained_eagle3_adaptive": lambda p=prompts: generate(
                model, p, drafter=untrained.drafter(), num_speculative_tokens=k, adaptive=True, **plain),
        }
        if batch == 1:
            runs["hf_assisted_prompt_lookup"] = lambda p=prompts: _hf_generate(
                hf, p, pad_id, max_new_tokens, prompt_lookup_num_tokens=k)
        times, outputs = interleaved(runs, repeats)
        reference = generate(model, prompts, packed_weights=False, **plain)  # F.linear at the weights' precision
        pack_linears(model, dtype=model.inference_dtype)  # what the reference run dropped, not in a timed run
        tokens = batch * max_new_tokens
        tps = {name: tokens / median(ts) for name, ts in times.items()}
        ar, spec, adaptive = outputs["codraft_ar"], outputs["codraft_ngram"], outputs["codraft_ngram_adaptive"]
        untrained_out = outputs["codraft_untrained_eagle3_adaptive"]
        same_as_hf = reference.tokens == outputs["hf_generate"]
        rows_as_reference = sum(a == b for a, b in zip(ar.tokens, reference.tokens, strict=True))
        spec_same_as_ar = all(o.tokens == ar.tokens for o in (spec, adaptive, untrained_out))
        step_s = ar.stats.time_verify_s / max(ar.stats.target_forwards, 1)
        mean_ctx = sum(map(len, prompts)) / batch + max_new_tokens / 2
        kv_bytes = 2 * args.num_layers * batch * args.num_kv_heads * mean_ctx * args.head_dim * 4
        floor_s = (weight_bytes + kv_bytes) / (bandwidth * 1e9)
        ratios = verify_cost_ratios(model, batch, int(mean_ctx), repeats)
        result = {
            "batch": batch,
            "tokens_per_s": tps,
            "times_s": times,
            "ratio_ar_vs_hf": tps["codraft_ar"] / tps["hf_generate"],
            "ratio_ngram_vs_ar": tps["codraft_ngram"] / tps["codraft_ar"],
            "ratio_adaptive_vs_ar": tps["codraft_ngram_adaptive"] / tps["codraft_ar"],
            "time_untrained_eagle3_adaptive_vs_ar": median(times["codraft_untrained_eagle3_adaptive"])
            / median(times["codraft_ar"]),
            "untrained_eagle3_k_histogram": dict(sorted(Counter(untrained_out.stats.k_chosen).items())),
            "ratio_hf_assisted_vs_hf": (tps["hf_assisted_prompt_lookup"] / tps["hf_generate"]
                                        if "hf_assisted_prompt_lookup" in tps else None),
            "tau_ngram": spec.stats.acceptance_length,
            "accept_rate_per_position_ngram": spec.stats.accept_rate_per_position,
            "tau_adaptive": adaptive.stats.acceptance_length,
            "adaptive_k_histogram": dict(sorted(Counter(adaptive.stats.k_chosen).items())),
            "adaptive_acceptance_estimates": controller.accept,
            "decode_step_ms": 1000 * step_s,
            "bandwidth_floor_step_ms": 1000 * floor_s,
            "step_vs_bandwidth_floor": step_s / floor_s,
            "verify_cost_ratio": ratios,
            "reference_identical_to_transformers": same_as_hf,
            "ar_rows_identical_to_reference": rows_as_reference,
            "speculative_identical_to_ar": spec_same_as_ar,
        }
        results.append(result)
        log.info("batch %d: %s", batch, {k_: round(v, 3) if isinstance(v, float) else v for k_, v in result.items()
                                          if k_ not in ("times_s", "tokens_per_s")})
        rows.append([batch, tps["codraft_ar"], tps["hf_generate"], result["ratio_ar_vs_hf"], tps["codraft_ngram"],
                     result["tau_ngram"], tps["codraft_ngram_adaptive"], result["ratio_adaptive_vs_ar"],
                     str(result["adaptive_k_histogram"]), result["time_untrained_eagle3_adaptive_vs_ar"],
                     tps.get("hf_assisted_prompt_lookup", float("nan")), result["decode_step_ms"],
                     result["bandwidth_floor_step_ms"], result["step_vs_bandwidth_floor"], same_as_hf,
                     f"{rows_as_reference}/{batch}", spec_same_as_ar])
        cost_rows.append([batch, *(f"{ratios['plain'][t]:.2f} / {ratios['packed'][t]:.2f}" for t in VERIFY_TOKENS)])
    header = ["batch", "codraft AR tok/s", "HF generate tok/s", "AR / HF", "codraft n-gram tok/s", "tau n-gram",
              "codraft adaptive tok/s", "adaptive / AR", "adaptive k used", "untrained EAGLE-3 adaptive time / AR",
              "HF assisted tok/s", "decode ms/step", "bandwidth floor ms/step", "step / floor", "reference tokens = HF",
              "AR rows = reference", "spec tokens = AR"]
    table = markdown_table(header, rows)
    table += (f"\nk = {k}, {max_new_tokens} new tokens per row, greedy, medians of {repeats} interleaved repeats; "
              f"read bandwidth {bandwidth:.1f} GB/s; codraft's matmuls in {matmul_dtype} (the head in the weights' "
              f"dtype), {weight_bytes / 1e6:.0f} MB of weights read per step; reference = codraft with F.linear at "
              f"the weights' precision, HF generate in it too.\n\n")
    table += markdown_table(["batch", *(f"{t} tokens / decode (plain / packed)" for t in VERIFY_TOKENS)], cost_rows)
    table += "\nTarget forward of t tokens per row over the cache relative to a 1-token decode step at the same " \
             f"batch, plain F.linear against the packed weights the engine uses ({', '.join(kernels)}); " \
             "interleaved, medians.\n"
    payload = {"machine": machine(), "bandwidth_gbs": bandwidth, "matmul_dtype": matmul_dtype,
               "matmul_kernels": kernels, "weight_bytes_per_step": weight_bytes, "k": k,
               "max_new_tokens": max_new_tokens, "repeats": repeats, "results": results}
    write_results(out_dir, "rollout", payload, table)
    return payload
