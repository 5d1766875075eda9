"""The co-training step under pipeline parallelism (parallel.pp > 1; parallel.dp replicas, parallel.cp per stage):
the PP `Sharding` and `PipelineTrainer`.

Per step, on the pp ranks of one pipeline (DESIGN.md, "The co-training step under PP and CP"):

  weights     every rank holds the full policy and the draft, for generation; its training stage (build_stage) is
              a view of the full policy's tensors (load_state_dict(assign=True)), so a stage's optimizer step
              updates that rank's full copy in place;
  rollout     pipeline rank 0 generates with the full policy and draft and broadcasts the rollout and its torch
              RNG state (as under CP): every stage trains on the same samples;
  update      split_rollouts -> run_pipeline (JointObjective on the last stage, taps over a TapChannel built for
              the step) -> sum_tied_grads -> one clip over all stages (squared norms summed over the pipeline, the
              tied head counted once) -> every stage's optimizer steps; the draft trains on the last stage;
  refit       every stage broadcasts its weights into every rank's full copy, the last stage the draft
              (time/refit_s);
  metrics     the last stage broadcasts its loss metrics to the pipeline; global rank 0 writes them;
  checkpoints every rank calls save(): the stages' optimizer and scheduler states are gathered to the pipeline's
              first rank, and global rank 0 writes its refitted full policy and the draft (the pp = 1 layout)
              with one optimizer file per stage (`policy_stage{s}`) and the draft's; a run resumes with the same
              pp, each stage loading its own optimizer state.

Data parallelism (dp > 1): replica r trains on its own slice of every step's prompts (ReplicaTask) and rollout;
after the backward, stage and draft gradients are averaged over the dp group (the mean of the replicas' losses),
so the replicas keep identical weights; an update is skipped on every replica when one cannot run it, and the
step's metrics are averaged over the replicas.

Context parallelism (cp > 1): each stage is replicated over a CP group and each CP rank runs its own pipeline
(and TapChannel) on its zigzag share of every microbatch (`cp_train.cp_view`): ring attention in the stage, ring
branch attention and the CP look-ahead in the draft. The first stage's CP group shares the rollout before the
pipelines do; the CP shares of the gradients are summed before the dp mean, as in `cp_train`.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from codraft.config import Config, ConfigError
from codraft.models.linear import unpack_linears
from codraft.parallel.cp_draft import apply_cp_to_draft
from codraft.parallel.cp_train import cp_view
from codraft.parallel.dp_task import ReplicaTask
from codraft.parallel.group_sharding import GroupSharding, all_reduce_grads
from codraft.parallel.mesh import ParallelDims, init_distributed
from codraft.parallel.pipeline import (
    StageModule,
    build_stage,
    run_pipeline,
    stage_state_dict,
    sum_tied_grads,
    tap_sources,
)
from codraft.parallel.ring_attention import apply_cp
from codraft.parallel.tapchannel import TapChannel, TapSpec
from codraft.rl.batch import PackedRollouts
from codraft.rl.microbatch import split_rollouts
from codraft.rl.pipeline_loss import JointObjective
from codraft.rl.sharding import BatchView
from codraft.rl.trainer import Trainer

log = logging.getLogger(__name__)


class PipelineParallel(GroupSharding):
    """The pp ranks of one pipeline share every step's rollout; ParallelDims has built the groups. With cp > 1
    every stage is replicated over a CP group: one pipeline per CP rank, each on its zigzag share of every
    microbatch (ring attention in the stage, ring branch attention in the draft), all on the same rollout."""

    def __init__(self, dims: ParallelDims):
        super().__init__(dims, dims.pp_group, dims.pp_ranks)

    def apply(self, policy: nn.Module, draft: nn.Module | None) -> None:
        super().apply(policy, draft)
        if draft is not None:
            apply_cp_to_draft(draft, self.dims)  # cp = 1: unchanged

    def rollout(self, generate: Callable):
        """The first rank of the first stage's CP group generates; its CP group, then every pipeline, gets it."""
        if self.dims.cp == 1:
            return super().rollout(generate)
        first_stage = None
        if self.dims.pp_rank == 0:
            mine = (generate(), torch.get_rng_state()) if self.dims.cp_rank == 0 else None
            first_stage = self.broadcast(mine, self.dims.cp_ranks[0], self.dims.cp_group)
        rollout, rng = self.broadcast(first_stage)  # from this pipeline's first stage
        torch.set_rng_state(rng)
        return rollout

    def view(self, batch: PackedRollouts) -> BatchView:
        return cp_view(batch, self.dims.cp_group) if self.dims.cp > 1 else super().view(batch)

    def all_agree(self, flag: bool) -> bool:
        """True when `flag` holds on every data-parallel replica (collective over the dp group)."""
        if self.dims.dp == 1:
            return flag
        t = torch.tensor([int(flag)], device="cuda" if dist.get_backend() == "nccl" else "cpu")
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.dims.dp_group)
        return bool(t)

    def reduce_gradients(self, modules: list[nn.Module]) -> None:
        """The CP group's shares summed (the whole microbatches' gradient), then the mean of the dp replicas; one
        flat all-reduce per module and dimension."""
        if self.dims.cp > 1:
            all_reduce_grads(modules, self.dims.cp_group)
        if self.dims.dp > 1:
            all_reduce_grads(modules, self.dims.dp_group, divide_by=self.dims.dp)

    def average_metrics(self, metrics: dict[str, float]) -> dict[str, float]:
        """Each metric's mean over the replicas that report it (accept rates per position vary in number)."""
        if self.dims.dp == 1:
            return metrics
        everyone: list = [None] * self.dims.dp
        dist.all_gather_object(everyone, metrics, group=self.dims.dp_group)
        keys = dict.fromkeys(k for m in everyone for k in m)
        return {k: sum(vals) / len(vals) for k in keys if (vals := [float(m[k]) for m in everyone if k in m])}


def pipeline_sharding(cfg: Config) -> PipelineParallel:
    """The PP sharding from `parallel.*` and the launched world (torchrun's env)."""
    p = cfg.parallel
    if p.dp > 1 and cfg.rl.filter_zero_variance:
        # a replica whose groups were all filtered out would skip the update its peers wait in
        raise ConfigError(f"rl.filter_zero_variance=true is not supported with parallel.dp={p.dp} and "
                          f"parallel.pp={p.pp} yet: set it to false")
    _, world_size = init_distributed(p.timeout_s)
    dims = ParallelDims(p.dp, p.pp, p.cp, world_size)  # dp * pp * cp = the world size: same error everywhere
    return PipelineParallel(dims.build(p.timeout_s))


class PipelineTrainer(Trainer):
    """The trainer whose update is one pipeline step over this rank's stage (see the module docstring)."""

    sharding: PipelineParallel

    def __init__(self, cfg: Config, run_dir: Path | None, sharding: PipelineParallel):
        dims = sharding.dims
        self.pp_rank, self.pp, self.group = dims.pp_rank, dims.pp, dims.pp_group
        self.is_last = self.pp_rank == self.pp - 1
        super().__init__(cfg, run_dir, sharding)  # builds this rank's stage and optimizers, then resumes
        self.n_microbatches = cfg.parallel.pp_microbatches or 2 * self.pp
        self.trained = [self.stage] if self.draft_opt is None else [self.stage, self.draft]  # this rank's modules
        if dims.dp > 1:
            self.task = ReplicaTask(self.task, dims.dp_rank, dims.dp)
        args = self.policy.args
        self.taps = self.draft.tap_layers if self.draft is not None else ()
        self.tap_sources = tap_sources(self.taps, args.num_layers, self.pp) if self.taps else {}
        self.stage_keys = [self._refit_keys(s) for s in range(self.pp)]

    def _build_optimizers(self) -> None:
        """The policy optimizer steps this rank's stage; the draft trains on the last stage only."""
        self.stage = apply_cp(self._view_stage(self.pp_rank), self.sharding.dims)  # cp = 1: unchanged
        self.device = next(self.stage.parameters()).device
        super()._build_optimizers(self.stage, trains_draft=self.is_last)

    def _view_stage(self, s: int) -> nn.Module:
        """Stage s over the full policy's own tensors: no copy, and its updates are the full copy's."""
        with torch.device("meta"):
            stage = build_stage(self.policy.args, s, self.pp)
        stage.load_state_dict(stage_state_dict(self.policy.state_dict(), stage), assign=True)
        stage.init_buffers(next(self.policy.parameters()).device)
        return stage

    def _refit_keys(self, s: int) -> list[str]:
        """The full policy's tensors that stage s owns; a tied head is the embedding, which stage 0 owns."""
        with torch.device("meta"):
            keys = list(build_stage(self.policy.args, s, self.pp).state_dict())
        if self.policy.args.tie_word_embeddings and s > 0:
            keys = [k for k in keys if k != "lm_head.weight"]
        return keys

    def train_step(self) -> dict[str, float]:
        """The base step (its rollout, update and refit are this class's); metrics averaged over dp replicas."""
        return self.sharding.average_metrics(super().train_step())

    # --- one update: a pipeline step per optimizer step ----------------------------------------
    def _update(self, rollout, rows: list[list[int]], advantages: torch.Tensor, keep: torch.Tensor) -> dict:
        rl = self.cfg.rl
        idx = keep.nonzero().flatten().tolist()
        n_mb = min(self.n_microbatches, len(idx))
        if not self.sharding.all_agree(n_mb >= self.pp):  # a pipeline's ranks share the rollout: all skip together
            log.warning("step %d: too few sequences to fill %d pipeline stages: update skipped", self.step, self.pp)
            return {}
        mbs, ids = split_rollouts([rows[i] for i in idx], [rollout.tokens[i] for i in idx],
                                  [rollout.logprobs[i] for i in idx],
                                  advantages[keep].nan_to_num(0.0).to(self.device), n_mb, device=self.device,
                                  view=self.sharding.view)
        objective = JointObjective(rl, self.draft, mbs) if self.is_last else None
        self.stage.train()
        with self._tap_channel(ids.shape[1]) as channel:
            module = StageModule(self.stage, self.pp_rank, self.pp, self.taps,
                                 channel, self.draft if self.is_last else None, objective)
            module.metas = [mb.meta for mb in mbs]
            for _ in range(rl.optimizer_steps_per_batch):
                metrics = self._pipeline_step(module, ids if self.pp_rank == 0 else None)
                if channel is not None:
                    channel.reset()
                if metrics is None:  # a non-finite RL loss: the rest of the update is skipped, as at pp = 1
                    return {"loss/policy": float("nan")}
        return metrics

    def _tap_channel(self, tokens: int) -> TapChannel | nullcontext:
        """The TapChannel of this step (collective over the pipeline), sized to its microbatches."""
        if not self.tap_sources:  # no draft, or all its taps on the last stage
            return nullcontext()
        p = self.cfg.parallel
        dtype = next(self.stage.parameters()).dtype
        spec = TapSpec(tokens, self.policy.args.hidden_size, dtype, self.device.type)
        return TapChannel(self.tap_sources, spec, group=self.group, schedule=p.pp_schedule,
                          n_microbatches=self.n_microbatches, transport=p.tap_transport, timeout_s=p.timeout_s)

    def _pipeline_step(self, module: StageModule, ids: torch.Tensor | None) -> dict | None:
        """Forward + backward over all microbatches, clip over the pipeline, optimizer steps. Returns the step's
        metrics (the same on every rank), None when the RL loss was not finite and nothing stepped."""
        o, objective = self.cfg.optim, module.objective
        if objective is not None:
            objective.reset_metrics()
        run_pipeline(module, ids, schedule=self.cfg.parallel.pp_schedule, group=self.group, device=self.device)
        sum_tied_grads(self.stage, self.group)
        self.sharding.reduce_gradients(self.trained)
        report = self._last_stage_report(objective)
        self.skipped_draft_steps += report["skipped_draft"]
        metrics = report["metrics"]
        if not self.sharding.all_agree(report["finite"]):
            log.warning("non-finite RL loss at step %d: update skipped", self.step)
            self.policy_opt.zero_grad(set_to_none=True)
            if self.draft is not None:
                self.draft.zero_grad(set_to_none=True)
            return None
        metrics["grad_norm/policy"] = self._clip_policy(o.grad_clip or math.inf)
        self._step_optimizers()
        return metrics

    def _last_stage_report(self, objective: JointObjective | None) -> dict:
        """The last stage's loss metrics, finiteness and draft grad norm (clipped there, before the broadcast:
        the draft's gradients live on the last stage only), on every rank of the pipeline."""
        report = None
        if objective is not None:
            metrics = {k: float(v) for k, v in objective.metrics.items()}
            if self.draft_opt is not None:
                norm = torch.nn.utils.clip_grad_norm_(self.draft.parameters(), self.cfg.optim.draft_grad_clip
                                                      or math.inf)
                metrics["grad_norm/draft"] = float(norm)
            if objective.skipped_draft:
                log.warning("non-finite draft loss at step %d (%d microbatches): left out of the draft update",
                            self.step, objective.skipped_draft)
                metrics["loss/draft"] = float("nan")
            report = {"metrics": metrics, "finite": objective.finite, "skipped_draft": int(objective.skipped_draft > 0)}
        return self.sharding.broadcast(report, self.sharding.dims.pp_ranks[-1])

    def _clip_policy(self, max_norm: float) -> float:
        """clip_grad_norm_ over the whole policy: squared norms summed over the stages, the tied head (the last
        stage's copy of the embedding, whose gradient equals the embedding's) counted once."""
        params = [(n, p) for n, p in self.stage.named_parameters() if p.grad is not None]
        owned = set(self.stage_keys[self.pp_rank])  # without a tied head's second copy
        squares = [p.grad.detach().float().square().sum() for n, p in params if n in owned]
        total = torch.stack(squares).sum() if squares else torch.zeros((), device=self.device)
        dist.all_reduce(total, group=self.group)
        norm = total.sqrt()
        scale = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        for _, p in params:
            p.grad.mul_(scale.to(p.grad.dtype))
        return float(norm)

    # --- refit ------------------------------------------------------------------------------
    @torch.no_grad()
    def refit(self) -> None:
        """Every rank's full copy takes each stage's weights from that stage's rank, and the draft from the last."""
        full = self.policy.state_dict()
        ranks = self.sharding.dims.pp_ranks
        for s, keys in enumerate(self.stage_keys):
            for k in keys:
                dist.broadcast(full[k], src=ranks[s], group=self.group)
        if self.draft is not None:
            for t in (*self.draft.parameters(), *self.draft.buffers()):
                dist.broadcast(t.data, src=ranks[-1], group=self.group)
        for module in (self.policy, self.draft):  # broadcasts write behind the version counters packing reads
            if module is not None:
                unpack_linears(module)
        self.policy.eval()

    # --- checkpoints ------------------------------------------------------------------------
    def _optimizer_checkpoint(self) -> tuple[dict[str, dict], dict]:
        """Every stage's optimizer state (`policy_stage{s}`) and the draft's, gathered to the pipeline's first rank
        (collective over the pipeline); the schedulers step together, so stage 0's and the last stage's suffice."""
        if self.sharding.dims.dp_rank or self.sharding.dims.cp_rank:  # replicas of what global rank 0 writes
            return {}, {}
        optimizers, meta = super()._optimizer_checkpoint()
        everyone: list | None = [None] * self.pp if self.pp_rank == 0 else None
        dist.gather_object((_to_cpu(optimizers), meta["schedulers"]), everyone, dst=self.sharding.root,
                           group=self.group)
        if everyone is None:
            return {}, {}
        gathered = {name: state for states, _ in everyone for name, state in states.items()}  # draft: last stage
        schedulers = {"policy": meta["schedulers"]["policy"], "draft": everyone[-1][1]["draft"]}
        return gathered, {"schedulers": schedulers, "pipeline": {"pp": self.pp}}

    def _policy_optimizer_name(self) -> str:
        return f"policy_stage{self.pp_rank}"


def _to_cpu(state):
    """A (nested) optimizer state with its tensors on the host, for gathering and writing."""
    if isinstance(state, torch.Tensor):
        return state.cpu()
    if isinstance(state, dict):
        return {k: _to_cpu(v) for k, v in state.items()}
    if isinstance(state, list):
        return [_to_cpu(v) for v in state]
    return state
