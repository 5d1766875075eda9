"""Anchor sampling for block drafts (DFlash, DSpark).

An anchor is a packed position a whose token opens a training block
[x_a, MASK * (b-1)] at positions a..a+b-1; slot k of the block learns token a+k.
A position can anchor a block when
  - it is a response token (the engine's blocks start at the last emitted token),
  - the whole block lies inside its sequence (a block crossing the end is never
    sampled, so under CP a block's targets stay with its sequence), and
  - at least one of the slot targets a+1..a+b-1 is a response token.
Each sequence gets up to `num_anchors` of its valid positions, uniformly without
replacement, fixed by the generator.

A step's block tensors take their shapes from the anchor count G, and bf16 matmuls of shapes met for the first
time hold memory: DSpark's distillation on 640 chain answers, G drawn anew each step (171-256 blocks, of at most
16 sequences x 16 anchors), grew resident memory ~65 MB a step under `run.host_memory=keep` and would have run
out of the host's 24 GiB before step 300. So the loss pads G to a multiple of `num_anchors` with blocks it
weighs 0 (`pad_anchors`): a few counts recur, and the same run then grew ~11 MB a step (README, "Host memory").
"""

from __future__ import annotations

import torch


def valid_anchors(loss_mask: torch.Tensor, cu_seqlens: torch.Tensor, block_size: int) -> torch.Tensor:
    """[T] bool: positions that may anchor a block of `block_size` (see the module docstring)."""
    T = loss_mask.numel()
    device = loss_mask.device
    pos = torch.arange(T, device=device)
    lengths = cu_seqlens.diff().long()
    ends = cu_seqlens[1:].long().repeat_interleave(lengths, output_size=T)  # [T] end of each token's sequence
    inside = pos + block_size <= ends
    # response targets among a+1 .. a+b-1, from a prefix sum (slices past T clamp, `inside` rejects them anyway)
    csum = torch.nn.functional.pad(loss_mask.long().cumsum(0), (1, 0))  # csum[i] = responses before i
    targets = csum[(pos + block_size).clamp(max=T)] - csum[(pos + 1).clamp(max=T)]
    return loss_mask.bool() & inside & (targets > 0)


def sample_anchors(
    loss_mask: torch.Tensor,
    cu_seqlens: torch.Tensor,
    block_size: int,
    num_anchors: int,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Up to `num_anchors` valid anchors per sequence -> sorted packed positions [G] (long)."""
    T = loss_mask.numel()
    device = loss_mask.device
    valid = valid_anchors(loss_mask, cu_seqlens, block_size)
    lengths = cu_seqlens.diff().long()
    seq = torch.arange(lengths.numel(), device=device).repeat_interleave(lengths, output_size=T)
    # one sort orders every sequence's positions randomly, valid ones first (keys in [0, 1) vs [2, 3))
    noise = torch.rand(T, generator=generator, dtype=torch.float64, device=generator.device if generator else device)
    key = seq.double() * 4 + noise.to(device) + (~valid).double() * 2
    order = key.argsort()
    rank = torch.arange(T, device=device) - cu_seqlens.long()[seq[order]]  # rank of order[i] inside its sequence
    chosen = order[(rank < num_anchors) & valid[order]]
    return chosen.sort().values


def pad_anchors(anchors: torch.Tensor, multiple: int) -> tuple[torch.Tensor, torch.Tensor]:
    """anchors [G] -> [G'] (G' the next multiple of `multiple`; the added ones repeat the last, so sorted
    anchors stay sorted) and which are real [G'] bool: the loss weighs the others 0."""
    n = anchors.numel()
    pad = -n % multiple
    return torch.cat([anchors, anchors[-1:].expand(pad)]), torch.arange(n + pad, device=anchors.device) < n
