"""GRPO with online draft co-training: L = L_RL(theta) + lambda * L_draft(phi; sg(taps), sg(logits)).

`train_step` reads top to bottom: prompts -> speculative rollout with the current
policy and draft -> rewards -> group advantages -> ONE packed policy forward that
yields logits and taps -> RL loss + draft loss -> one backward -> the two
optimizers step -> refit -> metrics. The draft reads only detached taps and
logits, so the policy's gradient is exactly what it would be with lambda = 0.

Where tokens are computed is the `Sharding`'s business (rl/sharding.py: one device;
parallel/cp_train.py: context parallelism): the trainer sees a view of the batch and
one gradient reduction, never a rank.
"""

from __future__ import annotations

import logging
import math
import time
from pathlib import Path

import torch
from torch import nn

from codraft.commands.common import load_policy, read_draft
from codraft.config import Config, ConfigError
from codraft.drafts import DraftModel, build_draft
from codraft.drafts.export import check_family
from codraft.models import Tokenizer, Transformer
from codraft.parallel.cp_train import sharding_for
from codraft.rl.batch import pack_rollouts, per_sequence
from codraft.rl.checkpoint import save_checkpoint
from codraft.rl.drift import drift_probe
from codraft.rl.grpo import group_advantages, grpo_loss_for, rewards_tensor, zero_variance_groups
from codraft.rl.prompts import PromptEncoder, prompt_corpus
from codraft.rl.resume import load_resumable, resume_sections
from codraft.rl.reward_guard import RewardGuard
from codraft.rl.rewards import load_reward_fn, score
from codraft.rl.sharding import Sharding
from codraft.rl.tasks import ArithmeticTask, ChainTask, IndexedTask, JsonlTask
from codraft.rollout import SpeculationController, generate

log = logging.getLogger(__name__)


def build_task(cfg: Config) -> IndexedTask:
    t = cfg.task
    if t.kind == "chain":
        return ChainTask(t.min_operand, t.max_operand, t.chain_min_terms, t.chain_max_terms, t.operators,
                         seed=cfg.run.seed)
    if t.kind == "jsonl":
        try:
            return JsonlTask(t.path, seed=cfg.run.seed)
        except ValueError as e:  # the row and field at fault
            raise ConfigError(f"task.path {e}") from e
    return ArithmeticTask(t.min_operand, t.max_operand, t.num_terms, t.operators, seed=cfg.run.seed)


def prompt_encoder(cfg: Config, policy: Transformer, tokenizer: Tokenizer) -> PromptEncoder:
    """Prompts leave room in the policy's context for what a rollout appends, as the engine counts it."""
    rl = cfg.rl
    speculative = rl.num_speculative_tokens if cfg.draft.family != "none" else 0
    return PromptEncoder(tokenizer, cfg.task.chat_template, policy.args.max_position_embeddings,
                         rl.max_new_tokens + speculative + 1)


def warmup(steps: int):
    return lambda step: min(1.0, (step + 1) / steps) if steps else 1.0


class Trainer:
    def __init__(self, cfg: Config, run_dir: Path | None, sharding: Sharding | None = None):
        """`run_dir`: where `save` writes; None until the command has made it, after every input is checked."""
        self.cfg, self.run_dir = cfg, run_dir
        self.sharding = sharding or sharding_for(cfg)
        torch.manual_seed(cfg.run.seed)  # draft init, anchor sampling; saved and restored with checkpoints
        self.policy, self.tokenizer = load_policy(cfg)
        self.task = build_task(cfg)
        try:
            self.reward_fn = load_reward_fn(cfg.task.reward)
        except ValueError as e:
            raise ConfigError(f"task.reward: {e}") from e
        self.reward_guard = RewardGuard(cfg.task.reward, cfg.rl)
        self.encode = prompt_encoder(cfg, self.policy, self.tokenizer)
        self.draft = self._build_draft(prompt_corpus(self.task, self.encode, 256))  # every JSONL row checked first
        # the step-0 policy's answers to held-out prompts, taken before any resume loads later weights
        self.drift = drift_probe(cfg, build_task(cfg), self.policy, self.encode) if cfg.rl.drift_every else None
        self.sharding.apply(self.policy, self.draft)
        self._build_optimizers()
        rl = cfg.rl
        # one controller for the whole run: what it learns of acceptance and cost carries over between steps
        self.controller = (
            SpeculationController(rl.num_speculative_tokens)
            if self.draft is not None and rl.num_speculative_tokens and rl.adaptive
            else None
        )
        self.step = 0
        self.skipped_draft_steps = 0
        if cfg.checkpoint.resume is not None:
            self._resume()

    def _build_optimizers(self, policy: nn.Module | None = None, trains_draft: bool = True) -> None:
        """AdamW with warm-up for `policy` (the parameters this rank steps; default the whole policy) and, when
        this rank trains it, the draft."""
        o = self.cfg.optim
        policy = self.policy if policy is None else policy
        self.policy_opt = torch.optim.AdamW(policy.parameters(), lr=o.lr, weight_decay=o.weight_decay)
        self.policy_sched = torch.optim.lr_scheduler.LambdaLR(self.policy_opt, warmup(o.warmup_steps))
        self.draft_opt = self.draft_sched = None
        if self.draft is not None and trains_draft:
            self.draft_opt = torch.optim.AdamW(
                self.draft.parameters(), lr=o.draft_lr, weight_decay=o.draft_weight_decay
            )
            self.draft_sched = torch.optim.lr_scheduler.LambdaLR(self.draft_opt, warmup(o.draft_warmup_steps))

    def _build_draft(self, corpus: list[list[int]]) -> DraftModel | None:
        cfg = self.cfg
        if cfg.draft.family == "none":
            return None
        if cfg.checkpoint.draft_init == "auto":
            from codraft.drafts.warm_start import warm_start_draft  # lazy: distillation imports this module

            return warm_start_draft(cfg, self.policy, self.tokenizer)
        if cfg.checkpoint.draft_init is not None:
            return check_family(read_draft(cfg.checkpoint.draft_init, self.policy, "checkpoint.draft_init"),
                                "checkpoint.draft_init", "draft.family", cfg.draft.family)
        return build_draft(cfg.draft, self.policy, self.tokenizer, corpus)

    # --- one step ------------------------------------------------------------------------
    def train_step(self) -> dict[str, float]:
        cfg, rl = self.cfg, self.cfg.rl
        t_step = time.perf_counter()

        # 1. data
        problems = self.task.sample(rl.prompts_per_step)
        prompts = [self.encode(p) for p in problems]
        rows = [p for p in prompts for _ in range(rl.group_size)]
        row_problems = [p for p in problems for _ in range(rl.group_size)]

        # 2. rollout with the current policy and draft
        self.policy.eval()
        rollout = self.sharding.rollout(
            lambda: generate(
                self.policy,
                rows,
                drafter=self.draft.drafter() if self.draft is not None else None,
                num_speculative_tokens=rl.num_speculative_tokens,
                temperature=rl.temperature,
                top_p=rl.top_p,
                max_new_tokens=rl.max_new_tokens,
                seed=cfg.run.seed * 1_000_003 + self.step,
                adaptive=self.controller if self.controller is not None else False,
            )
        )
        t_rollout = time.perf_counter() - t_step

        # 3. rewards -> group-normalised advantages
        texts = [self.tokenizer.decode(ids, skip_special_tokens=True) for ids in rollout.tokens]
        errors: list[str] = []
        rewards, dropped = score(texts, row_problems, self.reward_fn, errors)
        if not self.sharding.all_agree(not self.reward_guard.exceeded(dropped, len(rows), errors)):
            raise self.reward_guard.failure()  # before an update that would train on nothing
        reward_t = rewards_tensor(rewards)
        advantages = group_advantages(reward_t, rl.group_size, scale_by_std=rl.scale_by_std)
        keep = torch.ones(len(rows), dtype=torch.bool)
        if rl.filter_zero_variance:
            keep = ~zero_variance_groups(reward_t, rl.group_size)

        # 4-7. one packed forward -> RL + draft loss -> one backward -> optimizer steps
        t_train = time.perf_counter()
        train_metrics = self._update(rollout, rows, advantages, keep) if bool(keep.any()) else {}
        t_train = time.perf_counter() - t_train

        # 8. refit the rollout engine's weights
        t_refit = time.perf_counter()
        self.refit()
        t_refit = time.perf_counter() - t_refit

        self.step += 1
        stats = rollout.stats
        finite = reward_t[~reward_t.isnan()]
        metrics = {
            "reward/mean": float(finite.mean()) if finite.numel() else float("nan"),
            "reward/accuracy": float((finite >= 1.0).float().mean()) if finite.numel() else float("nan"),
            "reward/dropped": float(dropped),
            "response_length/mean": sum(map(len, rollout.tokens)) / len(rows),
            "response_length/max": float(max(map(len, rollout.tokens))),  # the tail the rollout waits for
            "spec/acceptance_length": stats.acceptance_length,
            "spec/draft_tokens": float(stats.draft_tokens_proposed),
            "rollout/tokens_per_s": stats.tokens_per_s,
            "time/rollout_s": t_rollout,
            "time/train_s": t_train,
            "time/refit_s": t_refit,
            "time/step_s": time.perf_counter() - t_step,
            "draft/skipped_steps": float(self.skipped_draft_steps),
        }
        metrics |= {f"spec/accept_rate_pos_{i}": r for i, r in enumerate(stats.accept_rate_per_position)}
        if self.drift is not None and self.step % rl.drift_every == 0:  # outside time/step_s: not part of the step
            metrics |= self.drift.measure(self.policy)
        return metrics | train_metrics

    def refit(self) -> None:
        """The engine decodes with these very modules, updated in place: nothing to copy."""
        self.policy.eval()

    def _update(self, rollout, rows: list[list[int]], advantages: torch.Tensor, keep: torch.Tensor) -> dict:
        rl, o = self.cfg.rl, self.cfg.optim
        idx = keep.nonzero().flatten().tolist()
        batch = pack_rollouts(
            [rows[i] for i in idx],
            [rollout.tokens[i] for i in idx],
            [rollout.logprobs[i] for i in idx],
            device=next(self.policy.parameters()).device,
        )
        adv = advantages[keep].nan_to_num(0.0).to(batch.input_ids.device)
        inference_lp, mask = per_sequence(batch.inference_logprobs, batch)
        view = self.sharding.view(batch)  # the tokens this rank computes on
        self.policy.train()
        old_lp = None
        metrics: dict[str, float] = {}
        for _ in range(rl.optimizer_steps_per_batch):
            taps = self.draft.tap_layers if self.draft is not None else ()
            out = self.policy(
                view.input_ids[None], cu_seqlens=view.cu_seqlens, positions=view.positions[None], taps=taps
            )
            logits = out.logits[0]  # [T_local, V]
            logprobs, _ = per_sequence(view.response_logprobs(logits, rl.temperature), batch)  # whole batch
            old_lp = logprobs.detach() if old_lp is None else old_lp  # the rollout policy's, this batch
            rl_loss, rl_metrics = grpo_loss_for(rl, logprobs, old_lp, adv, mask, inference_lp)
            if not torch.isfinite(rl_loss):
                log.warning("non-finite RL loss at step %d: update skipped", self.step)
                self.policy_opt.zero_grad(set_to_none=True)
                return {"loss/policy": float("nan")}
            loss = rl_loss
            draft_metrics: dict[str, float] = {}
            if self.draft is not None and rl.draft_weight > 0:
                taps_out = {i: t[0] for i, t in out.taps.items()}  # [T_local, H]
                draft_loss, draft_metrics = self.draft.loss(view.draft_batch(taps_out, logits))
                if torch.isfinite(draft_loss):
                    loss = loss + rl.draft_weight * draft_loss
                else:  # a broken draft may cost acceptance, never the policy
                    self.skipped_draft_steps += 1
                    log.warning("non-finite draft loss at step %d: draft update skipped", self.step)
                    draft_metrics = {"loss/draft": float("nan")}
            loss.backward()
            self.sharding.reduce_gradients([m for m in (self.policy, self.draft) if m is not None])
            grad_norm_policy = torch.nn.utils.clip_grad_norm_(self.policy.parameters(), o.grad_clip or math.inf)
            metrics = rl_metrics | draft_metrics | {"grad_norm/policy": float(grad_norm_policy)}
            if self.draft_opt is not None:
                grad_norm_draft = torch.nn.utils.clip_grad_norm_(self.draft.parameters(), o.draft_grad_clip or math.inf)
                metrics["grad_norm/draft"] = float(grad_norm_draft)
            self._step_optimizers()
        metrics["entropy"] = float(view.response_entropy(logits.detach(), rl.temperature))
        return metrics

    def _step_optimizers(self) -> None:
        """The optimizers this rank holds, and their schedulers, step on the reduced and clipped gradients,
        which are then cleared."""
        for opt, sched in ((self.policy_opt, self.policy_sched), (self.draft_opt, self.draft_sched)):
            if opt is not None:
                opt.step()
                sched.step()
                opt.zero_grad(set_to_none=True)

    # --- checkpoints ----------------------------------------------------------------------
    def save(self) -> Path | None:
        """Write a checkpoint (collective: every rank calls it; the writer writes). Returns its path on the writer."""
        optimizers, meta = self._optimizer_checkpoint()
        if not self.sharding.is_writer:
            return None
        tensors = {"policy": self.policy.state_dict(), "rng": {"torch": torch.get_rng_state()}}
        if self.draft is not None:
            tensors["draft"] = self.draft.state_dict()
        meta |= {
            "task": self.task.state_dict(),
            "skipped_draft_steps": self.skipped_draft_steps,
            "config": resume_sections(self.cfg),
        }
        return save_checkpoint(
            self.run_dir, self.step, tensors=tensors, optimizers=optimizers, meta=meta, keep=self.cfg.checkpoint.keep
        )

    def _policy_optimizer_name(self) -> str:
        """The policy optimizer's file stem in a checkpoint."""
        return "policy"

    def _optimizer_checkpoint(self) -> tuple[dict[str, dict], dict]:
        """(optimizer states by checkpoint name, their entries of meta.json) as the writer stores them."""
        optimizers = {self._policy_optimizer_name(): self.policy_opt.state_dict()}
        if self.draft_opt is not None:
            optimizers["draft"] = self.draft_opt.state_dict()
        schedulers = {"policy": self.policy_sched.state_dict(),
                      "draft": self.draft_sched.state_dict() if self.draft_sched else None}
        return optimizers, {"schedulers": schedulers}

    def _resume(self) -> None:
        ckpt = load_resumable(self.cfg)  # the newest complete checkpoint, refused before anything is loaded
        meta = ckpt["meta"]
        missing, unexpected = self.policy.load_state_dict(ckpt["tensors"]["policy"], strict=False)
        tied = {"lm_head.weight"} if self.policy.args.tie_word_embeddings else set()  # stored once, as the embedding
        if set(missing) - tied or unexpected:
            raise ConfigError(
                f"checkpoint.resume: policy weights do not fit (missing {missing}, unexpected {unexpected})"
            )
        if self.draft is not None:
            self.draft.load_state_dict(ckpt["tensors"]["draft"])
        self._load_optimizer_states(ckpt)
        torch.set_rng_state(ckpt["tensors"]["rng"]["torch"])
        self.task.load_state_dict(meta["task"])
        self.skipped_draft_steps = meta["skipped_draft_steps"]
        self.step = meta["step"]
        log.info("resumed from %s at step %d", ckpt["path"], self.step)

    def _load_optimizer_states(self, ckpt: dict) -> None:
        self.policy_opt.load_state_dict(ckpt["optimizers"][self._policy_optimizer_name()])
        self.policy_sched.load_state_dict(ckpt["meta"]["schedulers"]["policy"])
        if self.draft_opt is not None:
            self.draft_opt.load_state_dict(ckpt["optimizers"]["draft"])
            self.draft_sched.load_state_dict(ckpt["meta"]["schedulers"]["draft"])
