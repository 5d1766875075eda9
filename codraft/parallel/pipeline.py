"""Pipeline parallelism for the policy on torch.distributed.pipelining, with the draft on the last stage.

Only tensors flow between stages, so a stage module takes the microbatch index `mb` as a tensor kwarg (every
stage's `schedule.step` gets the same `arange(n_microbatches)`, which the schedule chunks to one index per
microbatch) and looks up what else the microbatch needs (cu_seqlens, positions, real length) in a per-step
table. Microbatches are groups of whole sequences, padded to one length so the pipeline's P2P buffers fit all.

stage 0 .. S-2: layers -> post the taps of the layers they own to TapChannel -> hidden to the next stage
stage S-1:      layers, norm, head -> logits; fetch the other stages' taps -> `objective(mb, logits, taps)`,
                whose scalar (RL loss + lambda * draft loss, pre-scaled to the whole batch) the schedule backprops.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from codraft.models import ModelArgs, Transformer
from codraft.models.autocast import training_autocast
from codraft.parallel.tapchannel import TapChannel
from codraft.rl.batch import MicrobatchMeta


def _pipelining():
    """torch.distributed.pipelining, imported at the first pipeline step: it pulls in torch._dynamo and DTensor,
    1.8 s of the 5.3 s that importing the trainer took on a 2-core CPU, paid by every rank of every run without
    pipeline parallelism too."""
    import torch.distributed.pipelining as pipelining

    return pipelining


# (microbatch, logits [tokens, V], taps {layer: [tokens, H]}) -> the microbatch's share of the step's loss
Objective = Callable[[int, torch.Tensor, dict[int, torch.Tensor]], torch.Tensor]


def stage_layers(num_layers: int, pp: int) -> list[tuple[int, int]]:
    """[first, last) layer range of every stage: an even split, the first stages taking one more when uneven."""
    assert 1 <= pp <= num_layers, f"parallel.pp={pp} is checked against the {num_layers} layers at policy load"
    sizes = [num_layers // pp + (s < num_layers % pp) for s in range(pp)]
    bounds = [sum(sizes[:s]) for s in range(pp + 1)]
    return list(zip(bounds[:-1], bounds[1:], strict=True))


def build_stage(args: ModelArgs, pp_rank: int, pp: int) -> Transformer:
    """Stage `pp_rank` of `pp`: its layers, the embedding on the first stage, norm + head on the last."""
    return Transformer(args, layers=stage_layers(args.num_layers, pp)[pp_rank])


def stage_state_dict(full: dict[str, torch.Tensor], stage: Transformer) -> dict[str, torch.Tensor]:
    """The slice of a full model's state dict that `stage` holds. A tied head on a last stage without the
    embedding starts as a copy of the embedding (the two stay equal: their gradients are summed every step)."""
    wanted = stage.state_dict().keys()
    if "lm_head.weight" in wanted and "lm_head.weight" not in full:
        full = full | {"lm_head.weight": full["embed_tokens.weight"]}
    return {k: full[k] for k in wanted}


def stage_view(policy: Transformer, pp_rank: int, pp: int) -> Transformer:
    """Stage `pp_rank` over the full policy's own tensors: no copy, and its optimizer steps update the full
    copy in place (which generates the next rollout after a refit)."""
    with torch.device("meta"):
        stage = build_stage(policy.args, pp_rank, pp)
    stage.load_state_dict(stage_state_dict(policy.state_dict(), stage), assign=True)
    stage.init_buffers(next(policy.parameters()).device)
    return stage


def stage_keys(args: ModelArgs, pp_rank: int, pp: int) -> list[str]:
    """The full policy's tensors that stage `pp_rank` owns; a tied head is the embedding, which stage 0 owns."""
    with torch.device("meta"):
        keys = list(build_stage(args, pp_rank, pp).state_dict())
    if args.tie_word_embeddings and pp_rank > 0:
        keys = [k for k in keys if k != "lm_head.weight"]
    return keys


def tap_sources(tap_layers: tuple[int, ...], num_layers: int, pp: int) -> dict[int, list[int]]:
    """{stage: [tap layers it owns]} for the stages other than the last (whose taps stay local)."""
    ranges = stage_layers(num_layers, pp)
    owner = {layer: s for s, (first, last) in enumerate(ranges) for layer in range(first, last)}
    assert all(layer in owner for layer in tap_layers), f"tap layers {tap_layers} are checked at policy load"
    sources: dict[int, list[int]] = {}
    for layer in tap_layers:
        if owner[layer] != pp - 1:
            sources.setdefault(owner[layer], []).append(layer)
    return sources


class StageModule(nn.Module):
    """One pipeline stage as the pipelining API wants it: forward(tensor, mb=tensor) -> tensor.

    `model` is the policy stage; on the last stage `draft` (a submodule, so it is checkpointed and optimised with
    the stage) and `objective` turn logits and taps into the loss. `metas` is set before every step.
    """

    def __init__(self, model: Transformer, stage: int, pp: int, tap_layers: tuple[int, ...] = (),
                 channel: TapChannel | None = None, draft: nn.Module | None = None,
                 objective: Objective | None = None, matmul_dtype: str = "float32"):
        super().__init__()
        self.model, self.stage, self.pp = model, stage, pp
        self.matmul_dtype = matmul_dtype  # the policy's training forward (rl.policy_matmul_dtype)
        self.is_last = stage == pp - 1
        self.own_taps = [layer for layer in tap_layers if layer in model.layer_ids]
        self.channel, self.draft, self.objective = channel, draft, objective
        self.metas: list[MicrobatchMeta] = []
        assert not self.is_last or objective is not None, "the last stage computes the loss"

    def forward(self, x: torch.Tensor, mb: torch.Tensor) -> torch.Tensor:
        """x: token ids [1, L] (first stage) or hidden [1, L, H]; mb: [1] microbatch index."""
        m = int(mb)
        meta = self.metas[m]
        with training_autocast(self.model, self.matmul_dtype):
            out = self.model(x, positions=meta.positions, cu_seqlens=meta.cu_seqlens, taps=self.own_taps,
                             logit_rows=meta.logit_rows if self.is_last else None)
        taps = {layer: t[0, : meta.tokens].detach() for layer, t in out.taps.items()}  # [tokens, H], no way back
        if not self.is_last:
            if taps and self.channel is not None:
                self.channel.post(m, taps)
            return out.hidden
        if self.channel is not None:
            taps |= self.channel.fetch(m)
        return self.objective(m, out.logits[0, : meta.tokens], taps).reshape(1)  # [1]: the schedule concatenates


def _loss_is_output(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return output.sum()  # the last stage already returns its loss, as [1]


def run_pipeline(module: StageModule, input_ids: torch.Tensor | None, *, schedule: str,
                 group: dist.ProcessGroup | None, device: torch.device) -> list[torch.Tensor]:
    """Forward and backward of one step over microbatches of `input_ids` [n_mb, L] (first stage only) under
    `schedule` ("1F1B" | "GPipe"); gradients accumulate in the stage's parameters, unscaled (the objective
    already weights each microbatch by its share of the batch). Returns the microbatch losses (last stage)."""
    n_mb = len(module.metas)
    pipelining = _pipelining()
    stage = pipelining.PipelineStage(module, module.stage, module.pp, device, *_example_io(module), group=group)
    schedules = {"1F1B": pipelining.Schedule1F1B, "GPipe": pipelining.ScheduleGPipe}
    sched = schedules[schedule](stage, n_mb, loss_fn=_loss_is_output, scale_grads=False)
    args = (input_ids,) if module.stage == 0 else ()
    index = torch.arange(n_mb, device=device)
    losses: list[torch.Tensor] = []
    target = index if module.is_last else None  # the schedule wants a target on the last stage; the loss is made
    sched.step(*args, mb=index, target=target, losses=losses)
    return losses


def run_pipeline_forward(module: StageModule, input_ids: torch.Tensor | None, *, group: dist.ProcessGroup | None,
                         device: torch.device) -> None:
    """Forward only, without gradient, of every microbatch of `input_ids` [n_mb, L] (first stage only): the
    schedule's eval path (GPipe, no loss), so the last stage's `objective` sees each microbatch's logits once."""
    n_mb = len(module.metas)
    pipelining = _pipelining()
    stage = pipelining.PipelineStage(module, module.stage, module.pp, device, *_example_io(module), group=group)
    args = (input_ids,) if module.stage == 0 else ()
    with torch.no_grad():
        pipelining.ScheduleGPipe(stage, n_mb).eval(*args, mb=torch.arange(n_mb, device=device))


def _example_io(module: StageModule) -> tuple[torch.Tensor, torch.Tensor]:
    """Static input/output metadata of one microbatch, so the schedule never runs a stage forward of its own to
    infer shapes (a forward posts taps: it must run exactly once per microbatch)."""
    length = int(module.metas[0].positions.shape[1])
    args = module.model.args
    dtype = next(module.model.parameters()).dtype
    hidden = torch.empty(1, length, args.hidden_size, dtype=dtype, device="meta", requires_grad=True)
    inputs = torch.empty(1, length, dtype=torch.long, device="meta") if module.stage == 0 else hidden
    outputs = torch.empty(1, dtype=torch.float32, device="meta") if module.is_last else hidden
    return inputs, outputs


def sum_tied_grads(model: Transformer, group: dist.ProcessGroup | None) -> None:
    """A tied embedding/head exists twice under PP (embedding on the first stage, head on the last): sum their
    gradients so both copies take the step the one tied weight takes at pp = 1. Collective over `group`."""
    args = model.args
    if not args.tie_word_embeddings or dist.get_world_size(group) == 1:
        return
    holder = model.embed_tokens if model.embed_tokens is not None else model.lm_head
    weight = holder.weight if holder is not None else None
    grad = weight.grad if weight is not None and weight.grad is not None else None
    if grad is None:  # middle stages (and a stage that saw no gradient) add zeros
        param = next(model.parameters())
        grad = torch.zeros(args.vocab_size, args.hidden_size, dtype=param.dtype, device=param.device)
    dist.all_reduce(grad, group=group)
    if weight is not None:
        weight.grad = grad
