"""Rollout batches for training: packing sequences into one varlen sequence, the microbatches a step splits
them into, and the view of a packed batch that one process computes on (`BatchView`: every token here;
`parallel/cp_view.py` is the context-parallel view, this rank's zigzag share)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from codraft.drafts import DraftBatch
from codraft.drafts.shard import TokenShard
from codraft.models.model import packed_positions


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


# --- the view of a batch one process computes on ---

# (logits rows [R, V], the token each row predicts [R]) -> a value per row [R]
RowFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class BatchView:
    """The tokens of a packed rollout batch that this rank computes on, and the way back from per-token
    results to the whole batch's response tokens. Single device: the whole batch."""

    batch: PackedRollouts
    input_ids: torch.Tensor  # [T_local]
    positions: torch.Tensor  # [T_local] rotary positions within each sequence
    cu_seqlens: torch.Tensor  # [N+1] local
    loss_mask: torch.Tensor  # [T_local] bool, response tokens (False on padding)
    shard: TokenShard  # where the local tokens sit in the whole batch (the draft's look-ahead)

    def per_response(self, fn: RowFn, logits: torch.Tensor) -> torch.Tensor:
        """fn over the logits rows [T_local, V] that predict response tokens -> [R] in response order."""
        b = self.batch
        return fn(logits[b.logprob_index], b.input_ids[b.logprob_index + 1])

    def logit_rows(self) -> torch.Tensor:
        """[R_local] the local rows that predict a response token: the only logits the RL loss and the draft's
        loss read (a draft's target outside the response is masked)."""
        return self.batch.logprob_index

    def response_logprobs(self, logits: torch.Tensor, temperature: float) -> torch.Tensor:
        """[R] log p of every response token, differentiable."""
        return self.per_response(lambda rows, targets: token_logprobs(rows, targets, temperature), logits)

    @torch.no_grad()
    def response_entropy(self, logits: torch.Tensor, temperature: float) -> torch.Tensor:
        """Mean entropy of the policy's sampling distribution over response tokens."""
        return self.per_response(lambda rows, _: token_entropy(rows, temperature), logits).mean()

    def draft_batch(self, taps: dict[int, torch.Tensor], logits: torch.Tensor) -> DraftBatch:
        """The draft's training batch of the local tokens: taps {layer: [T_local, H]}, logits [T_local, V]."""
        return DraftBatch(
            input_ids=self.input_ids,
            taps={i: t.detach() for i, t in taps.items()},
            policy_logits=logits.detach(),
            loss_mask=self.loss_mask,
            cu_seqlens=self.cu_seqlens,
            positions=self.positions,
            shard=self.shard,
        )


def whole_view(batch: PackedRollouts) -> BatchView:
    """The view of a process that computes on the whole batch."""
    shard = TokenShard(batch.input_ids, batch.response_mask, batch.cu_seqlens)
    return BatchView(batch, batch.input_ids, packed_positions(batch.cu_seqlens), batch.cu_seqlens,
                     batch.response_mask, shard)


# --- microbatches (pp = 1: one, the whole batch; under PP groups of whole sequences) ---


@dataclass
class MicrobatchMeta:
    """What a stage needs about one microbatch besides the tensor that flows into it."""

    cu_seqlens: torch.Tensor  # [n + 1] or [n + 2]: the microbatch's sequences, then any padding as one more
    positions: torch.Tensor  # [1, L] rotary positions
    tokens: int  # real (unpadded) tokens; taps and logits beyond them are padding
    # the positions whose logits some loss reads (they predict a response token): the head runs on these only,
    # the other rows of the logits are zero (its matmul is a fifth of a 135M model's FLOPs, and most rows are
    # prompt); None: every row
    logit_rows: torch.Tensor | None = None


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
        meta = MicrobatchMeta(cu_seqlens=cu, positions=positions[None], tokens=tokens, logit_rows=v.logit_rows())
        microbatches.append(Microbatch(b, advantages[g.to(advantages.device)], meta, v))
    return microbatches, ids
