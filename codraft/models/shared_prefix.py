"""A training forward over GRPO rows with each group's prompt computed once.

The rows of a group answer one prompt. Packed row after row (rl/batch.py), the policy's training forward runs the
prompt once per row: on the e2e chain workload (~95-token prompts, ~115-token answers, 4 rows a group) 45% of the
tokens it runs are repeats. Here each group is laid out once as [prompt | answer_1 | ... | answer_n], every answer
at the positions it has in its own row, and attention lets an answer's token see the prompt and the earlier tokens
of its own answer only. Each token then sees exactly what it sees in its row, so hidden states and logits are the
rows' (to rounding), and a prompt token's gradient is the sum of what its copies received. The layout's states are
gathered back into the rows' packed order, so the losses and the draft read what they always read.

Single process only (pp = 1, cp = 1): the shapes a pipeline's stages exchange, and CP's zigzag shards, are cut
from the rows' layout.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from codraft.models.model import Attention, ModelOutput, Transformer, tokens_first_sdpa


@dataclass
class SharedPrefixLayout:
    """Groups of rows with one prompt, each laid out once (`input_ids`), and the way back to the rows' order."""

    input_ids: torch.Tensor  # [1, T'] each group's prompt, then its rows' completions
    positions: torch.Tensor  # [1, T'] a token's position in its own row (rotary)
    cu_seqlens: torch.Tensor  # [G + 1] one span per group
    prompt_lengths: list[int]  # [G]
    answer_masks: list[list[torch.Tensor]]  # [G][rows of the group] `_answer_mask`s: built once, read by every layer
    gather: torch.Tensor  # [T] for each token of the rows' packed layout, its index in this one

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
        """`Attention.packed_attention` over this layout: q [T', H, D], k/v [T', Hkv, D] -> [T', H, D]. Per group the
        prompt attends causally, then each answer attends to [prompt, itself]: the keys each row saw, under a mask
        per answer (its tokens x those keys), none over the whole group."""
        out = torch.empty_like(q)
        for start, prompt, masks in zip(cu_seqlens[:-1].tolist(), self.prompt_lengths, self.answer_masks, strict=True):
            shared = slice(start, start + prompt)
            out[shared] = tokens_first_sdpa(q[shared], k[shared], v[shared])
            at = start + prompt
            for mask in masks:
                own = slice(at, at + mask.shape[0])
                keys, values = (torch.cat([t[shared], t[own]]) for t in (k, v))
                out[own] = tokens_first_sdpa(q[own], keys, values, mask)
                at = own.stop
        return out


def shared_prefix_layout(prompts: list[list[int]], completions: list[list[int]],
                         device: torch.device | str = "cpu") -> SharedPrefixLayout | None:
    """The layout of rows (prompt + completion each, in the order `pack_rollouts` packs them) whose consecutive
    rows with equal prompts form a group; None when no two consecutive rows share one (nothing to save)."""
    groups: list[list[int]] = []
    for i, prompt in enumerate(prompts):
        if groups and prompts[groups[-1][0]] == prompt:
            groups[-1].append(i)
        else:
            groups.append([i])
    if len(groups) == len(prompts):
        return None
    ids: list[int] = []
    positions: list[int] = []
    row_index: list[list[int]] = [[] for _ in prompts]  # per row: where its tokens sit in the layout
    spans = [0]
    for rows in groups:
        start, prompt = len(ids), prompts[rows[0]]
        ids += prompt
        positions += range(len(prompt))
        for r in rows:
            at = len(ids)
            ids += completions[r]
            positions += range(len(prompt), len(prompt) + len(completions[r]))
            row_index[r] = list(range(start, start + len(prompt))) + list(range(at, len(ids)))
        spans.append(len(ids))
    return SharedPrefixLayout(
        input_ids=torch.tensor(ids, dtype=torch.long, device=device)[None],
        positions=torch.tensor(positions, dtype=torch.long, device=device)[None],
        cu_seqlens=torch.tensor(spans, device=device),
        prompt_lengths=[len(prompts[rows[0]]) for rows in groups],
        answer_masks=[[_answer_mask(len(prompts[r]), len(completions[r]), device) for r in rows] for rows in groups],
        gather=torch.tensor([i for index in row_index for i in index], dtype=torch.long, device=device),
    )


def _answer_mask(prompt: int, n: int, device: torch.device | str) -> torch.Tensor:
    """[n, prompt + n] bool: an answer's query i sees the prompt and the answer's tokens 0..i."""
    return torch.ones(n, prompt + n, dtype=torch.bool, device=device).tril(prompt)


@contextmanager
def _attending(model: nn.Module, layout: SharedPrefixLayout) -> Iterator[None]:
    """The model's packed attention swapped for the layout's for one forward (its graph keeps the ops it ran)."""
    layers = [m for m in model.modules() if isinstance(m, Attention)]
    before = [m.packed_attention for m in layers]
    for m in layers:
        m.packed_attention = layout.attention
    try:
        yield
    finally:
        for m, attention in zip(layers, before, strict=True):
            m.packed_attention = attention


def shared_prefix_forward(model: Transformer, layout: SharedPrefixLayout, taps: tuple[int, ...],
                          logit_rows: torch.Tensor) -> ModelOutput:
    """`model`'s packed training forward of the rows, run on `layout`: hidden states and taps [1, T, H] and logits
    [1, T, V] (computed at `logit_rows` only, zero elsewhere) in the rows' packed order."""
    with _attending(model, layout):
        out = model(layout.input_ids, positions=layout.positions, cu_seqlens=layout.cu_seqlens, taps=taps,
                    compute_logits=False)
    hidden = out.hidden.index_select(1, layout.gather)
    return ModelOutput(logits=model.logits_at(hidden, logit_rows), hidden=hidden,
                       taps={layer: t.index_select(1, layout.gather) for layer, t in out.taps.items()})
