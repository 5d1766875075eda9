"""Draft distillation before RL: the policy answers task prompts, the draft learns to predict those answers.

`start_distillation` generates the responses with the rollout engine, builds the draft (EAGLE-3's
draft vocabulary from the responses' token counts) and returns a `Distiller`; each `step()` then
reads top to bottom: a batch of responses -> the policy's taps and logits for it -> `draft.loss` ->
backward -> clip -> AdamW step on the draft only.

The policy is frozen, so by default its outputs are computed once per response (`PolicyOutputs`) and
every epoch reuses them: the taps as they are, and of the rows that predict response tokens (the only rows
the draft losses read) what the family's loss reads of the logits, as fp16 log-probabilities (EAGLE-3's draft
vocabulary), or, for a family that reads the whole vocabulary, the policy's last hidden states, from which
each batch runs the head again. With `draft_train.cache_policy_outputs = false` each step runs its own
no-grad packed policy forward instead.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch

from codraft.config import Config, DraftTrainConfig
from codraft.distill.responses import policy_responses
from codraft.drafts import DraftBatch, DraftModel, build_draft
from codraft.models import Tokenizer, Transformer
from codraft.models.autocast import training_autocast
from codraft.observability import progress
from codraft.rl.batch import PackedRollouts, pack_rollouts, whole_view
from codraft.rl.tasks import JsonlTask, build_prompt_ids, build_task, task_stream

log = logging.getLogger(__name__)


def split_prompts(cfg: Config, tokenizer: Tokenizer, held_out: int) -> tuple[list[list[int]], list[list[int]]]:
    """Token ids of `draft_train.num_prompts` training prompts and the `held_out` after them in the task stream."""
    dt, task = cfg.draft_train, build_task(cfg)
    problems = task.sample(dt.num_prompts + held_out)
    if isinstance(task, JsonlTask) and len(task.problems) < len(problems):
        log.warning("task.path holds %d problems, fewer than draft_train.num_prompts + held-out = %d: "
                    "held-out prompts repeat training ones", len(task.problems), len(problems))
    ids = [build_prompt_ids(tokenizer, p, cfg.task.chat_template) for p in problems]
    return ids[: dt.num_prompts], ids[dt.num_prompts :]


def distillation_prompts(cfg: Config) -> dict:
    """Which prompts a draft distilled under `cfg` learned from: the first draft_train.num_prompts of its task stream
    (rl.tasks.task_stream). Exported with the draft (`codraft_trained_on`), so `codraft bench draft` can hold out
    the prompts after them."""
    return {"stream": task_stream(cfg), "num_prompts": cfg.draft_train.num_prompts}


def _pack(prompts: list[list[int]], completions: list[list[int]], device: torch.device) -> PackedRollouts:
    """prompt + response pairs packed as training packs rollouts (the log-probs are not read here)."""
    return pack_rollouts(prompts, completions, [[0.0] * len(c) for c in completions], device=device)


@torch.no_grad()
def draft_batch(policy: Transformer, draft: DraftModel, prompts: list[list[int]],
                completions: list[list[int]]) -> DraftBatch:
    """One packed policy forward over prompt + response -> the draft's training batch (taps, logits detached)."""
    packed = _pack(prompts, completions, next(policy.parameters()).device)
    out = policy(packed.input_ids[None], cu_seqlens=packed.cu_seqlens, taps=draft.tap_layers)
    return whole_view(packed).draft_batch({layer: t[0] for layer, t in out.taps.items()}, out.logits[0])


@dataclass
class PolicyOutputs:
    """The frozen policy's detached outputs for one (prompt, response), as every epoch's draft batches read them."""

    taps: dict[int, torch.Tensor]  # policy layer -> [T_i, H]
    # [R_i, W] fp16: the draft's `policy_rows` of the policy's log-softmax at the rows that predict the R_i
    # response tokens (EAGLE-3: its draft vocabulary and a flag, W = N + 1). None for a family that reads the
    # whole vocabulary (DFlash, DSpark): `hidden` is kept instead and the rows recomputed from it per batch
    logprobs: torch.Tensor | None
    # [R_i, H]: the policy's last hidden states at those rows, H fp32 numbers a row instead of V fp16 ones (SmolLM2:
    # 42x less; 640 answers of the chain task held 7.6 GB of log-probs); the head then runs at each batch
    hidden: torch.Tensor | None = None

    def nbytes(self) -> int:
        return sum(t.nbytes for t in (*self.taps.values(), self.logprobs, self.hidden) if t is not None)


def _logprob_rows(draft: DraftModel, logits: torch.Tensor) -> torch.Tensor:
    """[R, V] policy logits -> the draft's `policy_rows` of their log-softmax, rounded to fp16 before the family
    reduces them, as the cache holds them."""
    return draft.policy_rows(logits.float().log_softmax(-1).half())


@torch.no_grad()
def policy_outputs(policy: Transformer, draft: DraftModel, prompts: list[list[int]], completions: list[list[int]],
                   batch_size: int) -> list[PolicyOutputs]:
    """`PolicyOutputs` of every pair, from packed policy forwards of `batch_size` sequences."""
    outputs, whole = [], draft.reads_whole_vocabulary
    device = next(policy.parameters()).device
    for i in progress(range(0, len(prompts), batch_size), desc="policy outputs"):
        packed = _pack(prompts[i : i + batch_size], completions[i : i + batch_size], device)
        predicts = packed.response_mask[1:].nonzero().flatten()  # rows predicting response tokens (prompts not empty)
        # the head runs only where the cache keeps its rows: nowhere when it keeps hidden states
        out = policy(packed.input_ids[None], cu_seqlens=packed.cu_seqlens, taps=draft.tap_layers,
                     compute_logits=not whole, logit_rows=None if whole else predicts)
        bounds = list(zip(packed.cu_seqlens[:-1].tolist(), packed.cu_seqlens[1:].tolist(), strict=True))
        sizes = [int(packed.response_mask[start:end].sum()) for start, end in bounds]
        if whole:
            rows = [(None, h.clone()) for h in out.hidden[0][predicts].split(sizes)]
        else:
            rows = [(lp, None) for lp in _logprob_rows(draft, out.logits[0][predicts]).split(sizes)]
        for (start, end), (lp, h) in zip(bounds, rows, strict=True):
            outputs.append(PolicyOutputs({layer: t[0, start:end].clone() for layer, t in out.taps.items()}, lp, h))
    log.info("cached the policy's taps and response %s of %d responses: %.2f GB",
             "hidden states" if draft.reads_whole_vocabulary else "log-probs", len(outputs),
             sum(o.nbytes() for o in outputs) / 1e9)
    return outputs


def cached_batch(prompts: list[list[int]], completions: list[list[int]], outputs: list[PolicyOutputs],
                 policy: Transformer | None = None, draft: DraftModel | None = None) -> DraftBatch:
    """The DraftBatch `draft_batch` would build, from cached outputs (the draft's `policy_rows` of the policy's
    rows; recomputed with `policy` and `draft` where the cache holds hidden states): rows that predict no response
    token (which no draft loss reads) hold zeros."""
    if any(o.logprobs is None for o in outputs):
        assert policy is not None and draft is not None, "hidden states cached: the policy's head and the draft"
        with torch.no_grad():
            rows = _logprob_rows(draft, policy.logits(torch.cat([o.hidden for o in outputs])))
    else:
        rows = torch.cat([o.logprobs for o in outputs])
    device = rows.device
    packed = _pack(prompts, completions, device)
    logits = torch.zeros(packed.input_ids.numel(), rows.shape[-1], device=device)
    logits[packed.logprob_index] = rows.float()
    return DraftBatch(
        input_ids=packed.input_ids,
        taps={layer: torch.cat([o.taps[layer] for o in outputs]) for layer in outputs[0].taps},
        policy_logits=logits,
        loss_mask=packed.response_mask,
        cu_seqlens=packed.cu_seqlens,
        policy_reduced=True,
    )


def warmup_cosine(warmup_steps: int, total_steps: int, min_ratio: float):
    """lr multiplier: linear warm-up, then a cosine from 1 down to `min_ratio` at the last step."""
    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        done = (step - warmup_steps) / max(1, total_steps - 1 - warmup_steps)
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, done)))
    return factor


class Distiller:
    """AdamW on the draft over shuffled epochs of (prompt, response) pairs; the policy stays frozen."""

    def __init__(self, policy: Transformer, draft: DraftModel, prompts: list[list[int]],
                 completions: list[list[int]], dt: DraftTrainConfig, seed: int):
        self.policy, self.draft, self.dt = policy.eval(), draft, dt
        self.prompts, self.completions = prompts, completions
        self.cache = (policy_outputs(policy, draft, prompts, completions, dt.generate_batch_size)
                      if dt.cache_policy_outputs else None)
        self.opt = torch.optim.AdamW(draft.parameters(), lr=dt.lr, weight_decay=dt.weight_decay)
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, warmup_cosine(dt.warmup_steps, dt.steps,
                                                                               dt.min_lr_ratio))
        self.generator = torch.Generator().manual_seed(seed)
        self.order: list[int] = []
        self.skipped_steps = 0

    def next_rows(self) -> list[int]:
        rows = []
        while len(rows) < min(self.dt.batch_size, len(self.prompts)):
            if not self.order:
                self.order = torch.randperm(len(self.prompts), generator=self.generator).tolist()
            rows.append(self.order.pop())
        return rows

    def batch(self, rows: list[int]) -> DraftBatch:
        prompts, completions = [self.prompts[i] for i in rows], [self.completions[i] for i in rows]
        if self.cache is None:
            return draft_batch(self.policy, self.draft, prompts, completions)
        return cached_batch(prompts, completions, [self.cache[i] for i in rows], self.policy, self.draft)

    def step(self) -> dict[str, float]:
        batch = self.batch(self.next_rows())
        self.draft.train()
        with training_autocast(self.draft, self.dt.matmul_dtype):
            loss, metrics = self.draft.loss(batch)
        if not torch.isfinite(loss):  # e.g. no DFlash block fits in these responses
            self.skipped_steps += 1
            return metrics | {"loss/draft": float("nan"), "draft/skipped_steps": float(self.skipped_steps)}
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.draft.parameters(), self.dt.grad_clip or math.inf)
        lr = self.sched.get_last_lr()[0]
        self.opt.step()
        self.sched.step()
        self.opt.zero_grad(set_to_none=True)
        self.draft.eval()
        return metrics | {"grad_norm/draft": float(grad_norm), "lr/draft": lr,
                          "draft/skipped_steps": float(self.skipped_steps)}


def start_distillation(cfg: Config, policy: Transformer, tokenizer: Tokenizer,
                       prompts: list[list[int]]) -> Distiller:
    """Generate the policy's responses to `prompts`, build a fresh `draft.family` draft, return its Distiller."""
    completions = policy_responses(policy, prompts, cfg.draft_train, cfg.run.seed)
    torch.manual_seed(cfg.run.seed)  # draft init and anchor sampling
    draft = build_draft(cfg.draft, policy, tokenizer, corpus=completions)
    return Distiller(policy, draft, prompts, completions, cfg.draft_train, cfg.run.seed)


def live_accuracy(metrics: dict[str, float]) -> float:
    """The draft's first-token agreement with the policy, for progress bars (EAGLE-3 step 0, DFlash slot 1)."""
    return metrics.get("draft/acc_pos_0", float("nan"))
