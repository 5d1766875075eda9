"""Splitting a rollout batch into pipeline microbatches: groups of whole sequences, each packed on its own and
padded to one common length (the pipeline's P2P buffers have one shape for every microbatch)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from codraft.models.model import packed_positions
from codraft.parallel.pipeline import MicrobatchMeta
from codraft.rl.batch import PackedRollouts, pack_rollouts


@dataclass
class Microbatch:
    batch: PackedRollouts  # the microbatch's sequences, packed without padding
    advantages: torch.Tensor  # [n] of its sequences
    meta: MicrobatchMeta


def split_rollouts(prompts: list[list[int]], completions: list[list[int]], logprobs: list[list[float]],
                   advantages: torch.Tensor, n_microbatches: int, pad_to: int = 1,
                   device: torch.device | str = "cpu") -> tuple[list[Microbatch], torch.Tensor]:
    """Microbatches of consecutive sequences (equal counts, the first ones one more when uneven) and their token
    ids [n_microbatches, L], L = the longest microbatch rounded up to a multiple of `pad_to`."""
    if len(prompts) < n_microbatches:
        raise ValueError(f"{len(prompts)} sequences cannot fill {n_microbatches} pipeline microbatches")
    groups = torch.arange(len(prompts)).tensor_split(n_microbatches)
    packed = [pack_rollouts(*([seqs[i] for i in g.tolist()] for seqs in (prompts, completions, logprobs)),
                            device=device) for g in groups]
    longest = max(b.input_ids.numel() for b in packed)
    length = -(-longest // pad_to) * pad_to
    ids = torch.zeros(n_microbatches, length, dtype=torch.long, device=device)  # padding: token 0
    microbatches = []
    for i, (g, b) in enumerate(zip(groups, packed, strict=True)):
        tokens = b.input_ids.numel()
        ids[i, :tokens] = b.input_ids
        cu = b.cu_seqlens
        if length > tokens:  # padding is a sequence of its own: no real token attends to it
            cu = F.pad(cu, (0, 1), value=length)
        meta = MicrobatchMeta(cu_seqlens=cu, positions=packed_positions(cu)[None], tokens=tokens)
        microbatches.append(Microbatch(b, advantages[g.to(advantages.device)], meta))
    return microbatches, ids
