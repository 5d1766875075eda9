"""Packing a rollout batch into one varlen sequence for the single training forward."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class PackedRollouts:
    """Sequences prompt + completion laid end to end, token-major.

    Row r of the per-sequence tensors is sequence r; response tokens are the
    completion. `logprob_index` points, for each response token, at the packed
    position whose logits predict it (the position just before it).
    """

    input_ids: torch.Tensor  # [T]
    cu_seqlens: torch.Tensor  # [N+1]
    response_mask: torch.Tensor  # [T] bool, completion tokens
    logprob_index: torch.Tensor  # [R] packed positions t whose logits predict response token t+1
    response_seq: torch.Tensor  # [R] sequence of each response token
    inference_logprobs: torch.Tensor  # [R] log-probs recorded by the rollout engine

    @property
    def num_sequences(self) -> int:
        return self.cu_seqlens.numel() - 1

    def response_lengths(self) -> torch.Tensor:
        return torch.bincount(self.response_seq, minlength=self.num_sequences)


def pack_rollouts(prompts: list[list[int]], completions: list[list[int]], logprobs: list[list[float]],
                  device: torch.device | str = "cpu") -> PackedRollouts:
    ids, mask, seqlens = [], [], []
    for prompt, completion in zip(prompts, completions, strict=True):
        ids += prompt + completion
        mask += [False] * len(prompt) + [True] * len(completion)
        seqlens.append(len(prompt) + len(completion))
    input_ids = torch.tensor(ids, dtype=torch.long, device=device)
    response_mask = torch.tensor(mask, dtype=torch.bool, device=device)
    cu = F.pad(torch.tensor(seqlens, device=device).cumsum(0), (1, 0))
    positions = response_mask.nonzero().flatten()
    seq_of_token = torch.arange(len(seqlens), device=device).repeat_interleave(torch.tensor(seqlens, device=device))
    return PackedRollouts(
        input_ids=input_ids,
        cu_seqlens=cu,
        response_mask=response_mask,
        logprob_index=positions - 1,  # a prompt is never empty, so a response token never starts a sequence
        response_seq=seq_of_token[positions],
        inference_logprobs=torch.tensor([x for lp in logprobs for x in lp], dtype=torch.float32, device=device),
    )


def token_logprobs(rows: torch.Tensor, targets: torch.Tensor, temperature: float) -> torch.Tensor:
    """Logits rows [R, V] and the tokens they predict [R] -> log p(token) [R] at the sampling temperature, fp32."""
    rows = rows.float()
    if temperature > 0:
        rows = rows / temperature
    return rows.log_softmax(-1).gather(-1, targets[:, None]).squeeze(-1)


def token_entropy(rows: torch.Tensor, temperature: float) -> torch.Tensor:
    """Entropy [R] of the sampling distribution of each logits row [R, V], fp32."""
    logp = (rows.float() / temperature).log_softmax(-1)
    return -(logp.exp() * logp).sum(-1)


def per_sequence(values: torch.Tensor, batch: PackedRollouts, fill: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Scatter response-token values [R] into a padded [N, Lmax] grid and its mask."""
    lengths = batch.response_lengths()
    width = int(lengths.max()) if lengths.numel() else 0
    starts = F.pad(lengths.cumsum(0), (1, 0))[:-1]
    col = torch.arange(values.numel(), device=values.device) - starts[batch.response_seq]
    grid = torch.full((batch.num_sequences, width), fill, dtype=values.dtype, device=values.device)
    grid = grid.index_put((batch.response_seq, col), values)
    mask = torch.zeros(batch.num_sequences, width, dtype=torch.bool, device=values.device)
    mask[batch.response_seq, col] = True
    return grid, mask
