"""Splitting a rollout batch into pipeline microbatches: groups of whole sequences, each packed on its own, seen
through this rank's view (the whole microbatch, or this rank's zigzag share under CP) and padded to one common
length (the pipeline's P2P buffers have one shape for every microbatch)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from codraft.parallel.pipeline import MicrobatchMeta
from codraft.rl.batch import PackedRollouts, pack_rollouts
from codraft.rl.view import BatchView, whole_view


@dataclass
class Microbatch:
    batch: PackedRollouts  # the microbatch's sequences, packed without padding
    advantages: torch.Tensor  # [n] of its sequences
    meta: MicrobatchMeta
    view: BatchView  # the tokens of `batch` this rank computes on


def split_rollouts(prompts: list[list[int]], completions: list[list[int]], logprobs: list[list[float]],
                   advantages: torch.Tensor, n_microbatches: int, pad_to: int = 1,
                   device: torch.device | str = "cpu",
                   view: Callable[[PackedRollouts], BatchView] | None = None,
                   ) -> tuple[list[Microbatch], torch.Tensor]:
    """Microbatches of consecutive sequences (equal counts, the first ones one more when uneven) and the token ids
    this rank computes on [n_microbatches, L], L = the longest view rounded up to a multiple of `pad_to`.
    `view` is this rank's (parallel.cp_view.batch_view; default: one process computes the whole microbatch)."""
    view = view or whole_view
    if len(prompts) < n_microbatches:
        raise ValueError(f"{len(prompts)} sequences cannot fill {n_microbatches} pipeline microbatches")
    groups = torch.arange(len(prompts)).tensor_split(n_microbatches)
    packed = [pack_rollouts(*([seqs[i] for i in g.tolist()] for seqs in (prompts, completions, logprobs)),
                            device=device) for g in groups]
    views = [view(b) for b in packed]
    longest = max(v.input_ids.numel() for v in views)
    length = -(-longest // pad_to) * pad_to
    ids = torch.zeros(n_microbatches, length, dtype=torch.long, device=device)  # padding: token 0
    microbatches = []
    for i, (g, b, v) in enumerate(zip(groups, packed, views, strict=True)):
        tokens = v.input_ids.numel()
        ids[i, :tokens] = v.input_ids
        cu, positions = v.cu_seqlens, v.positions
        if length > tokens:  # padding is a sequence of its own: no real token attends to it
            cu = F.pad(cu, (0, 1), value=length)
            positions = F.pad(positions, (0, length - tokens))
        meta = MicrobatchMeta(cu_seqlens=cu, positions=positions[None], tokens=tokens)
        microbatches.append(Microbatch(b, advantages[g.to(advantages.device)], meta, v))
    return microbatches, ids
