"""GRPO with online draft co-training: L = L_RL(theta) + lambda * L_draft(phi; sg(taps), sg(logits)).

One `train_step` for every layout (pp = 1, cp, pp, pp x cp, dp x pp, plain dp), reading top to bottom:
prompts -> speculative rollout with the current policy and draft -> rewards -> group advantages ->
forward/backward of the joint objective (objective.py) over this rank's microbatches -> clip -> optimizer
steps -> refit -> metrics. The draft reads only detached taps and logits, so the policy's gradient is exactly
what it would be with lambda = 0.

Parallelism is applied from outside (parallel/parallelize.py: the trained module is the policy or this
rank's pipeline stage, with ring attention under CP); what crosses ranks is a plain function of the mesh
(parallel/collectives.py, its grad clip included); the step branches on the layout once, in `_forward_backward`:
at pp = 1 one microbatch of weight 1 and `backward()`, under PP the torch.distributed.pipelining schedule's
`step` with the objective on the last stage (parallel/pipeline.py, taps over a TapChannel).
"""

from __future__ import annotations

import logging
import time
from contextlib import nullcontext
from pathlib import Path

import torch

from codraft.config import Config, ConfigError
from codraft.distill.warm_start import initial_draft
from codraft.models import load_policy
from codraft.models.autocast import training_autocast
from codraft.models.shared_prefix import SharedPrefixLayout, shared_prefix_forward, shared_prefix_layout
from codraft.observability import timed
from codraft.parallel.collectives import (
    all_agree,
    average_metrics,
    broadcast_modules,
    clip_grad_norm_,
    from_last_stage,
    gather_to_first_stage,
    reduce_gradients,
    refit,
    share_rollout,
    sum_metrics,
)
from codraft.parallel.cp_view import batch_view
from codraft.parallel.dp_task import ReplicaTask
from codraft.parallel.mesh import ParallelDims, parallel_dims
from codraft.parallel.parallelize import parallelize_draft, parallelize_policy
from codraft.parallel.pipeline import StageModule, run_pipeline, stage_keys, sum_tied_grads, tap_sources
from codraft.parallel.tapchannel import TapChannel, TapSpec
from codraft.rl.batch import Microbatch, split_rollouts
from codraft.rl.drift import drift_probe
from codraft.rl.grpo import group_advantages, rewards_tensor, zero_variance_groups
from codraft.rl.prompts import prompt_corpus, prompt_encoder
from codraft.rl.reward_guard import RewardGuard
from codraft.rl.rewards import answer_correct, load_reward_fn, score
from codraft.rl.tasks import build_task
from codraft.rollout import Rollout, SpeculationController, generate
from codraft.rollout.speedup import measured_speedup, step_speedup
from codraft.train.checkpoint import load_policy_state, save_checkpoint
from codraft.train.objective import JointObjective
from codraft.train.optimizers import build_optimizer, step_and_zero
from codraft.train.reference import build_reference, reference_logprobs
from codraft.train.resume import load_resumable, resume_sections

log = logging.getLogger(__name__)


class Trainer:
    def __init__(self, cfg: Config, run_dir: Path | None, dims: ParallelDims | None = None):
        """`run_dir`: where `save` writes; None until the command has made it, after every input is checked.
        `dims`: the mesh (default: `parallel.*` over the launched world)."""
        self.cfg, self.run_dir = cfg, run_dir
        self.dims = dims = dims if dims is not None else parallel_dims(cfg)
        torch.manual_seed(cfg.run.seed)  # draft init, anchor sampling; saved and restored with checkpoints
        self.policy, self.tokenizer = load_policy(cfg)
        self.task = build_task(cfg)
        try:
            self.reward_fn = load_reward_fn(cfg.task.reward_spec)
        except ValueError as e:
            raise ConfigError(f"task.reward: {e}") from e
        self.reward_guard = RewardGuard(cfg.task.reward_spec, cfg.rl)
        self.encode = prompt_encoder(cfg, self.policy, self.tokenizer)
        # every JSONL row checked first (the corpus sets a fresh draft's vocabulary)
        self.draft = initial_draft(cfg, self.policy, self.tokenizer, prompt_corpus(self.task, self.encode, 256))
        # the step-0 policy's answers to held-out prompts, taken before any resume loads later weights
        self.drift = drift_probe(cfg, build_task(cfg), self.policy, self.encode) if cfg.rl.drift_every else None

        # parallelism, from outside: every rank starts from rank 0's weights, then trains its part
        broadcast_modules([self.policy, self.draft], dims)
        # rl.beta > 0: staged like the policy; copied before the policy's ring attention (it gets its own)
        self.reference = build_reference(cfg, self.policy, dims)
        self.stage = parallelize_policy(self.policy, dims)  # what this rank trains: the policy or its stage
        # rl.frozen_draft_every: the initial draft, never trained, scored beside the trained one where the draft's
        # loss runs; copied here, before a resume loads the trained draft's weights
        scored = self.draft is not None and cfg.rl.frozen_draft_every and cfg.rl.draft_weight > 0 and dims.is_last_stage
        self.frozen_draft = self.draft.frozen_copy() if scored else None
        for draft in (self.draft, self.frozen_draft):
            parallelize_draft(draft, dims)
        self.view = batch_view(dims)
        if dims.dp > 1:
            self.task = ReplicaTask(self.task, dims.dp_rank, dims.dp)
        self.device = next(self.stage.parameters()).device
        self.taps = self.draft.tap_layers if self.draft is not None else ()
        self.tap_sources = tap_sources(self.taps, self.policy.args.num_layers, dims.pp) if self.taps else {}
        self.stage_keys = [stage_keys(self.policy.args, s, dims.pp) for s in range(dims.pp)]
        self.n_microbatches = (cfg.parallel.pp_microbatches or 2 * dims.pp) if dims.pp > 1 else 1
        self.share_prompts = cfg.rl.share_prompts and dims.pp == 1 and dims.cp == 1
        if cfg.rl.share_prompts and not self.share_prompts and dims.is_writer:
            log.info("rl.share_prompts applies at pp = 1, cp = 1 only: each row runs its own prompt (pp = %d, cp = %d)",
                     dims.pp, dims.cp)

        o = cfg.optim
        self.policy_opt, self.policy_sched = build_optimizer(self.stage.parameters(), o.lr, o.weight_decay,
                                                             o.warmup_steps)
        self.draft_opt = self.draft_sched = None
        if self.draft is not None and dims.is_last_stage:  # the draft trains on the last stage
            self.draft_opt, self.draft_sched = build_optimizer(self.draft.parameters(), o.draft_lr,
                                                               o.draft_weight_decay, o.draft_warmup_steps)
        self.trained = [self.stage] if self.draft_opt is None else [self.stage, self.draft]  # this rank's modules
        rl = cfg.rl
        # one controller for the whole run: what it learns of acceptance and cost carries over between steps
        self.controller = (
            SpeculationController(rl.num_speculative_tokens)
            if self.draft is not None and rl.num_speculative_tokens and rl.adaptive
            else None
        )
        self.step = 0
        self.skipped_draft_steps = 0
        self.update_seconds: dict[str, float] = {}  # the step's JointObjective.seconds; {} without one on this rank
        if cfg.checkpoint.resume is not None:
            self._resume()

    # --- one step ------------------------------------------------------------------------
    def train_step(self) -> dict[str, float]:
        rl = self.cfg.rl
        t_step = time.perf_counter()

        # 1. data (this replica's share of the step's prompts under dp)
        problems = self.task.sample(rl.prompts_per_step)
        prompts = [self.encode(p) for p in problems]
        rows = [p for p in prompts for _ in range(rl.group_size)]
        row_problems = [p for p in problems for _ in range(rl.group_size)]

        # 2. rollout with the current policy and draft, generated once per replica
        self.policy.eval()
        rollout, speedup = share_rollout(lambda: self._rollout(rows), self.dims)
        # the measurement's plain rollout is not part of the step (its plain_s holds a re-pack it did not run)
        t_step += speedup.get("rollout/plain_s", 0.0) - speedup.get("rollout/policy_repack_s", 0.0)
        t_rollout = time.perf_counter() - t_step

        # 3. rewards -> group-normalised advantages
        texts = [self.tokenizer.decode(ids, skip_special_tokens=True) for ids in rollout.tokens]
        errors: list[str] = []
        rewards, dropped = score(texts, row_problems, self.reward_fn, errors)
        correct = [answer_correct(t, p) for t, p in zip(texts, row_problems, strict=True)]  # reward-independent
        if not all_agree(not self.reward_guard.exceeded(dropped, len(rows), errors), self.dims):
            raise self.reward_guard.failure()  # before an update that would train on nothing
        reward_t = rewards_tensor(rewards)
        advantages = group_advantages(reward_t, rl.group_size, scale_by_std=rl.scale_by_std)
        flat = zero_variance_groups(reward_t, rl.group_size)  # groups without GRPO signal
        keep = ~flat if rl.filter_zero_variance else torch.ones(len(rows), dtype=torch.bool)

        # 4-7. forward/backward of the joint objective -> clip -> optimizer steps
        t_train = time.perf_counter()
        self.update_seconds = {}
        train_metrics = self._update(rollout, rows, advantages, keep) if bool(keep.any()) else {}
        t_train = time.perf_counter() - t_train
        draft_time = self._draft_time()
        # the frozen control's scoring measures the run, as the drift probe does: not part of the step
        t_train -= draft_time.get("time/frozen_draft_s", 0.0)
        t_step += draft_time.get("time/frozen_draft_s", 0.0)

        # 8. refit the rollout engine's weights (pp = 1: it decodes with the trained modules themselves)
        t_refit = time.perf_counter()
        refit(self.policy, self.draft, self.dims, self.stage_keys)
        self.policy.eval()
        t_refit = time.perf_counter() - t_refit

        # 9. metrics
        self.step += 1
        stats = rollout.stats
        finite = reward_t[~reward_t.isnan()]
        metrics = {
            "reward/mean": float(finite.mean()) if finite.numel() else float("nan"),
            # the share of samples at full reward: under chain_steps every step and the answer right, not the
            # answer alone; that is reward/final_answer_accuracy, whatever the reward
            "reward/accuracy": float((finite >= 1.0).float().mean()) if finite.numel() else float("nan"),
            "reward/final_answer_accuracy": sum(correct) / len(correct),
            "reward/dropped": float(dropped),
            "reward/flat_groups": float(flat.float().mean()),
            "response_length/mean": sum(map(len, rollout.tokens)) / len(rows),
            "response_length/max": float(max(map(len, rollout.tokens))),  # the tail the rollout waits for
            "spec/acceptance_length": stats.acceptance_length,
            "spec/draft_tokens": float(stats.draft_tokens_proposed),
            "rollout/tokens_per_s": stats.tokens_per_s,
            "spec/mean_k": stats.mean_k,  # the controller's k, per verify step
            "spec/drafts_per_step": stats.drafts_per_step,  # what its speculative steps drafted
            "time/rollout_s": t_rollout,
            "time/rollout_draft_s": stats.time_draft_s,  # of time/rollout_s: proposals, verify forwards, prefill
            "time/rollout_verify_s": stats.time_verify_s,
            "time/rollout_prefill_s": stats.time_prefill_s,
            "time/train_s": t_train,
            "time/refit_s": t_refit,
            "time/step_s": time.perf_counter() - t_step,
            "draft/skipped_steps": float(self.skipped_draft_steps),
        }
        metrics |= {f"spec/accept_rate_pos_{i}": r for i, r in enumerate(stats.accept_rate_per_position)}
        metrics |= speedup | draft_time  # speedup: measured on this step, or nothing
        if speedup and "time/draft_train_s" in draft_time:  # the whole step against itself without a draft
            metrics |= step_speedup(metrics["time/step_s"], speedup["rollout/spec_s"], speedup["rollout/plain_s"],
                                    draft_time["time/draft_train_s"])
        if self.drift is not None and self.step % rl.drift_every == 0:  # outside time/step_s: not part of the step
            metrics |= self.drift.measure(self.policy)
        return average_metrics(metrics | train_metrics, self.dims)

    def _draft_time(self) -> dict[str, float]:
        """The update's seconds on the draft (`update_seconds`): time/draft_train_s (its
        loss's forward and backward, clip and optimizer step) and time/frozen_draft_s (the control's scoring, on the
        steps of rl.frozen_draft_every). At pp = 1 only: under PP the draft's backward runs inside the pipeline
        schedule, beside the other stages' work."""
        if self.draft is None or self.dims.pp > 1:
            return {}
        return {"time/draft_train_s": self.update_seconds.get("draft", 0.0),
                "time/frozen_draft_s": self.update_seconds.get("frozen_draft", 0.0)}

    def _rollout(self, rows: list[list[int]]) -> tuple[Rollout, dict[str, float]]:
        """The step's rollout with the current policy and draft; on the steps of rl.measure_speedup_every, also
        its speedup over plain decoding of the same rows, measured (rollout/speedup.py)."""
        rl = self.cfg.rl
        seed = self.cfg.run.seed * 1_000_003 + self.step
        sampling = dict(temperature=rl.temperature, top_p=rl.top_p)
        start = time.perf_counter()
        rollout = generate(
            self.policy,
            rows,
            drafter=self.draft.drafter() if self.draft is not None else None,
            num_speculative_tokens=rl.num_speculative_tokens,
            max_new_tokens=rl.max_new_tokens,
            seed=seed,
            adaptive=self.controller if self.controller is not None else False,
            verification=rl.verification,
            **sampling,
        )
        spec_s = time.perf_counter() - start
        every = rl.measure_speedup_every
        # steps every, 2 * every, ...: not the first, whose one-off costs (packing weights, each shape's first
        # forward) the speculative run pays and the plain run after it would not
        if self.draft is None or not rl.num_speculative_tokens or not every or (self.step + 1) % every:
            return rollout, {}
        return rollout, measured_speedup(self.policy, rollout, spec_s, seed=seed, **sampling)

    def _update(self, rollout, rows: list[list[int]], advantages: torch.Tensor, keep: torch.Tensor) -> dict:
        """rl.optimizer_steps_per_batch optimizer steps on this rank's microbatches of the kept sequences; on the
        last stage its objective's seconds on the draft are `update_seconds`."""
        dims, rl = self.dims, self.cfg.rl
        idx = keep.nonzero().flatten().tolist()
        n_mb = min(self.n_microbatches, len(idx))
        if not all_agree(n_mb >= dims.pp, dims):  # a pipeline's ranks share the rollout: all skip together
            log.warning("step %d: too few sequences to fill %d pipeline stages: update skipped", self.step, dims.pp)
            return {}
        mbs, ids = split_rollouts([rows[i] for i in idx], [rollout.tokens[i] for i in idx],
                                  [rollout.logprobs[i] for i in idx],
                                  advantages[keep].nan_to_num(0.0).to(self.device), n_mb, device=self.device,
                                  view=self.view)
        ref_lp = None  # rl.beta > 0: the frozen reference's log-probs, once per update
        if self.reference is not None:
            ref_lp = reference_logprobs(self.reference, mbs, ids, dims, rl.temperature)
        last = dims.is_last_stage
        every = rl.frozen_draft_every
        frozen = self.frozen_draft if every and (self.step + 1) % every == 0 else None  # steps N, 2N, ...
        objective = JointObjective(rl, self.draft, mbs, dims, ref_lp, frozen) if last else None
        if objective is not None:
            self.update_seconds = objective.seconds
        # pp = 1, cp = 1: each group's prompt runs once in the policy's forward (models/shared_prefix.py)
        shared = None
        if self.share_prompts:
            shared = shared_prefix_layout([rows[i] for i in idx], [rollout.tokens[i] for i in idx], self.device)
        self.stage.train()
        with self._tap_channel(ids.shape[1]) as channel:
            for _ in range(rl.optimizer_steps_per_batch):
                metrics = self._optimizer_step(objective, mbs, ids, channel, shared)
                if channel is not None:
                    channel.reset()
                if metrics is None:  # a non-finite RL loss: the rest of the update is skipped
                    return {"loss/policy": float("nan")}
        return metrics

    def _optimizer_step(self, objective: JointObjective | None, mbs: list[Microbatch], ids: torch.Tensor,
                        channel: TapChannel | None, shared: SharedPrefixLayout | None = None) -> dict | None:
        """Forward + backward over all microbatches, gradients reduced and clipped, optimizer steps. Returns the
        step's metrics (the same on every rank), None when the RL loss was not finite and nothing stepped."""
        dims, o = self.dims, self.cfg.optim
        if objective is not None:
            objective.reset_metrics()
        self._forward_backward(objective, mbs, ids, channel, shared)
        if dims.pp > 1:
            sum_tied_grads(self.stage, dims.pp_group)
        reduce_gradients(self.trained, dims)
        report = None
        if objective is not None:  # the last stage: the loss's metrics, and the draft's clip (its gradients live here)
            metrics = sum_metrics({k: float(v) for k, v in objective.metrics.items()}, dims)
            if self.draft_opt is not None:
                with timed(objective.seconds, "draft"):
                    metrics["grad_norm/draft"] = clip_grad_norm_(self.draft.parameters(), o.draft_grad_clip)
            if objective.skipped_draft:
                log.warning("non-finite draft loss at step %d (%d microbatches): left out of the draft update",
                            self.step, objective.skipped_draft)
                metrics["loss/draft"] = float("nan")
            report = {"metrics": metrics, "finite": objective.finite, "skipped_draft": int(objective.skipped_draft > 0)}
        report = from_last_stage(report, dims)
        self.skipped_draft_steps += report["skipped_draft"]
        metrics = report["metrics"]
        if not all_agree(report["finite"], dims):
            log.warning("non-finite RL loss at step %d: update skipped", self.step)
            for module_ in self.trained:
                module_.zero_grad(set_to_none=True)
            return None
        metrics["grad_norm/policy"] = self._clip_policy(o.grad_clip)
        step_and_zero(self.policy_opt, self.policy_sched)
        if self.draft_opt is not None:  # the last stage, where the objective is
            with timed(objective.seconds, "draft"):
                step_and_zero(self.draft_opt, self.draft_sched)
        return metrics

    def _forward_backward(self, objective: JointObjective | None, mbs: list[Microbatch], ids: torch.Tensor,
                          channel: TapChannel | None, shared: SharedPrefixLayout | None = None) -> None:
        """The one layout branch. pp = 1: the one microbatch (the whole batch, or this rank's CP share) through
        the policy (with `shared`, laid out with each group's prompt once), its loss, backward. PP: the pipeline
        schedule runs every microbatch's forward and backward, the objective on the last stage (gradients
        accumulate unscaled: the objective weights each microbatch by its share of the batch)."""
        dims = self.dims
        if dims.pp == 1:
            meta = mbs[0].meta
            with training_autocast(self.stage, self.cfg.rl.policy_matmul_dtype):
                if shared is not None:
                    out = shared_prefix_forward(self.stage, shared, self.taps, meta.logit_rows)
                else:
                    out = self.stage(ids, positions=meta.positions, cu_seqlens=meta.cu_seqlens, taps=self.taps,
                                     logit_rows=meta.logit_rows)
            taps = {layer: t[0].detach() for layer, t in out.taps.items()}  # [T, H]: the draft reads, never writes
            rl_term, draft_term = objective.terms(0, out.logits[0], taps)
            # one backward per term (their graphs are disjoint: the same gradients as one over their sum), so the
            # draft's share is timed; a term without a graph (non-finite, no draft) has nothing to propagate
            if draft_term is not None and draft_term.requires_grad:
                with timed(objective.seconds, "draft"):
                    draft_term.backward()
            if rl_term.requires_grad:
                rl_term.backward()
            return
        module = StageModule(self.stage, dims.pp_rank, dims.pp, self.taps, channel,
                             self.draft if dims.is_last_stage else None, objective, self.cfg.rl.policy_matmul_dtype)
        module.metas = [mb.meta for mb in mbs]
        run_pipeline(module, ids if dims.pp_rank == 0 else None, schedule=self.cfg.parallel.pp_schedule,
                     group=dims.pp_group, device=self.device)

    def _clip_policy(self, max_norm: float) -> float:
        """The clip over the whole policy: under PP, squared norms summed over the stages, a tied head (the last
        stage's copy of the embedding, whose gradient equals the embedding's) counted once."""
        if self.dims.pp == 1:
            return clip_grad_norm_(self.stage.parameters(), max_norm)
        owned = set(self.stage_keys[self.dims.pp_rank])
        counted = [p for n, p in self.stage.named_parameters() if n in owned]
        return clip_grad_norm_(self.stage.parameters(), max_norm, counted=counted, group=self.dims.pp_group)

    def _tap_channel(self, tokens: int) -> TapChannel | nullcontext:
        """The TapChannel of this step (collective over the pipeline), sized to its microbatches."""
        if self.dims.pp == 1 or not self.tap_sources:  # no draft, or all its taps on the last stage
            return nullcontext()
        p = self.cfg.parallel
        dtype = next(self.stage.parameters()).dtype
        spec = TapSpec(tokens, self.policy.args.hidden_size, dtype, self.device.type)
        return TapChannel(self.tap_sources, spec, group=self.dims.pp_group, schedule=p.pp_schedule,
                          n_microbatches=self.n_microbatches, transport=p.tap_transport, timeout_s=p.timeout_s)

    # --- checkpoints ----------------------------------------------------------------------
    def save(self) -> Path | None:
        """Write a checkpoint (collective: every rank calls it; global rank 0 writes its full policy, the draft
        and one optimizer state per stage). Returns its path on the writer."""
        optimizers, meta = self._optimizer_checkpoint()
        if not self.dims.is_writer:
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
        """The policy optimizer's file stem in a checkpoint: one per pipeline stage under PP."""
        return "policy" if self.dims.pp == 1 else f"policy_stage{self.dims.pp_rank}"

    def _optimizer_checkpoint(self) -> tuple[dict[str, dict], dict]:
        """(optimizer states by checkpoint name, their entries of meta.json) as the writer stores them: every
        stage's gathered to the pipeline's first rank (collective over the pipeline); the schedulers step
        together, so stage 0's and the last stage's suffice."""
        dims = self.dims
        if dims.dp_rank or dims.cp_rank:  # replicas of what global rank 0 writes
            return {}, {}
        optimizers = {self._policy_optimizer_name(): self.policy_opt.state_dict()}
        if self.draft_opt is not None:
            optimizers["draft"] = self.draft_opt.state_dict()
        schedulers = {"policy": self.policy_sched.state_dict(),
                      "draft": self.draft_sched.state_dict() if self.draft_sched else None}
        if dims.pp == 1:
            return optimizers, {"schedulers": schedulers}
        everyone = gather_to_first_stage((_to_cpu(optimizers), schedulers), dims)
        if everyone is None:
            return {}, {}
        gathered = {name: state for states, _ in everyone for name, state in states.items()}  # draft: last stage
        schedulers = {"policy": schedulers["policy"], "draft": everyone[-1][1]["draft"]}
        return gathered, {"schedulers": schedulers, "pipeline": {"pp": dims.pp}}

    def _resume(self) -> None:
        ckpt = load_resumable(self.cfg)  # the newest complete checkpoint, refused before anything is loaded
        meta = ckpt["meta"]
        try:
            load_policy_state(self.policy, ckpt["tensors"]["policy"])
        except ValueError as e:
            raise ConfigError(f"checkpoint.resume: {e}") from None
        if self.draft is not None:
            self.draft.load_state_dict(ckpt["tensors"]["draft"])
        self.policy_opt.load_state_dict(ckpt["optimizers"][self._policy_optimizer_name()])
        self.policy_sched.load_state_dict(meta["schedulers"]["policy"])
        if self.draft_opt is not None:
            self.draft_opt.load_state_dict(ckpt["optimizers"]["draft"])
            self.draft_sched.load_state_dict(meta["schedulers"]["draft"])
        torch.set_rng_state(ckpt["tensors"]["rng"]["torch"])
        self.task.load_state_dict(meta["task"])
        self.skipped_draft_steps = meta["skipped_draft_steps"]
        self.step = meta["step"]
        log.info("resumed from %s at step %d", ckpt["path"], self.step)


def _to_cpu(state):
    """A (nested) optimizer state with its tensors on the host, for gathering and writing."""
    if isinstance(state, torch.Tensor):
        return state.cpu()
    if isinstance(state, dict):
        return {k: _to_cpu(v) for k, v in state.items()}
    if isinstance(state, list):
        return [_to_cpu(v) for v in state]
    return state
