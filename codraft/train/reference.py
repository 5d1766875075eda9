"""The frozen reference policy of the KL term (rl.beta > 0): a copy of the initial policy, or the model at
model.ref_path; none is kept when rl.beta = 0.

It is parallelised like the policy: whole at pp = 1, this rank's pipeline stage (its layers only) under PP,
with ring attention under CP. Its log-probs of a step's rollout tokens are computed once per update, without
gradient, on the same views of the batch as the policy's: a forward of the one microbatch at pp = 1, a
forward-only pass through the stages under PP (the pipeline schedule's eval path)."""

from __future__ import annotations

import copy

import torch
from torch import nn

from codraft.config import Config
from codraft.models import Transformer, load_policy
from codraft.parallel.mesh import ParallelDims
from codraft.parallel.pipeline import StageModule, run_pipeline_forward, stage_view
from codraft.parallel.ring_attention import apply_cp
from codraft.rl.batch import Microbatch, per_sequence


def build_reference(cfg: Config, policy: Transformer, dims: ParallelDims) -> nn.Module | None:
    """This rank's part of the reference of `rl.beta` and `model.ref_path` (None at rl.beta = 0)."""
    if cfg.rl.beta == 0:
        return None
    source = policy if cfg.model.ref_path is None else _load(cfg, policy)
    part = source if dims.pp == 1 else stage_view(source, dims.pp_rank, dims.pp)  # a view: this stage's tensors
    if source is policy:
        part = copy.deepcopy(part)  # frozen where the policy starts: its own copy of this rank's tensors
    part.requires_grad_(False).eval()
    return apply_cp(part, dims)


def _load(cfg: Config, policy: Transformer) -> Transformer:
    reference, _ = load_policy(cfg, cfg.model.ref_path)  # its architecture was checked with the policy's load
    assert reference.args.num_layers == policy.args.num_layers, "load_policy checks model.ref_path's architecture"
    return reference


class _ResponseLogprobs:
    """A pipeline objective that keeps each microbatch's response log-probs [N, Lmax] and adds no loss."""

    def __init__(self, microbatches: list[Microbatch], temperature: float):
        self.microbatches, self.temperature = microbatches, temperature
        self.logprobs: dict[int, torch.Tensor] = {}

    def __call__(self, m: int, logits: torch.Tensor, taps: dict[int, torch.Tensor]) -> torch.Tensor:
        view = self.microbatches[m].view
        self.logprobs[m], _ = per_sequence(view.response_logprobs(logits, self.temperature), view.batch)
        return torch.zeros((), device=logits.device)


@torch.no_grad()
def reference_logprobs(reference: nn.Module, microbatches: list[Microbatch], ids: torch.Tensor, dims: ParallelDims,
                       temperature: float) -> list[torch.Tensor]:
    """The reference's log-probs [N, Lmax] of every microbatch's response tokens, on the last stage (an empty
    list on the others). `ids` [n_mb, L]: this rank's token ids of the microbatches. Collective over the mesh."""
    collect = _ResponseLogprobs(microbatches, temperature)
    if dims.pp == 1:
        for m, mb in enumerate(microbatches):
            out = reference(ids[m][None], positions=mb.meta.positions, cu_seqlens=mb.meta.cu_seqlens,
                            logit_rows=mb.meta.logit_rows)
            collect(m, out.logits[0, : mb.meta.tokens], {})
    else:
        module = StageModule(reference, dims.pp_rank, dims.pp, objective=collect if dims.is_last_stage else None)
        module.metas = [mb.meta for mb in microbatches]
        run_pipeline_forward(module, ids if dims.pp_rank == 0 else None, group=dims.pp_group, device=ids.device)
    return [collect.logprobs[m] for m in range(len(microbatches))] if dims.is_last_stage else []
