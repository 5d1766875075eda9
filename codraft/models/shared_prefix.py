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
import torch.nn.functional as F
from torch import nn

from codraft.models.model import Attention, ModelOutput, Transformer


@dataclass
class SharedPrefixLayout:
    """Groups of rows with one prompt, each laid out once (`input_ids`), and the way back to the rows' order."""

    input_ids: torch.Tensor  # [1, T'] each group's prompt, then its rows' completions
    positions: torch.Tensor  # [1, T'] a token's position in its own row (rotary)
    cu_seqlens: torch.Tensor  # [G + 1] one span per group
    masks: list[torch.Tensor]  # per group [L, L] bool: which keys each query sees
    gather: torch.Tensor  # [T] for each token of the rows' packed layout, its index in this one

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
        """`Attention.packed_attention` over this layout: q [T', H, D], k/v [T', Hkv, D] -> [T', H, D]."""
        out = torch.empty_like(q)
        bounds = cu_seqlens.tolist()
        for start, end, mask in zip(bounds[:-1], bounds[1:], self.masks, strict=True):
            qs, ks, vs = (t[start:end].transpose(0, 1) for t in (q, k, v))  # [H, L, D]
            out[start:end] = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask,
                                                            enable_gqa=True).transpose(0, 1)
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
    masks: list[torch.Tensor] = []
    row_index: list[list[int]] = [[] for _ in prompts]  # per row: where its tokens sit in the layout
    spans = [0]
    for rows in groups:
        start, prompt = len(ids), prompts[rows[0]]
        ids += prompt
        positions += range(len(prompt))
        segment = [-1] * len(prompt)  # -1: the prompt, seen by all; b: answer b, seen by itself only
        for b, r in enumerate(rows):
            at = len(ids)
            ids += completions[r]
            positions += range(len(prompt), len(prompt) + len(completions[r]))
            segment += [b] * len(completions[r])
            row_index[r] = list(range(start, start + len(prompt))) + list(range(at, len(ids)))
        seg = torch.tensor(segment, device=device)
        steps = torch.arange(seg.numel(), device=device)
        masks.append((steps[None] <= steps[:, None]) & ((seg[None] == -1) | (seg[None] == seg[:, None])))
        spans.append(len(ids))
    return SharedPrefixLayout(
        input_ids=torch.tensor(ids, dtype=torch.long, device=device)[None],
        positions=torch.tensor(positions, dtype=torch.long, device=device)[None],
        cu_seqlens=torch.tensor(spans, device=device),
        masks=masks,
        gather=torch.tensor([i for index in row_index for i in index], dtype=torch.long, device=device),
    )


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
