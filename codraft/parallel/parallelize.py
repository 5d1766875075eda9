"""Parallelism applied to the policy and the draft from outside, by functions of the mesh (torchtitan's
`parallelize_*`): the modules themselves never branch on the layout.

  policy  pp = 1: the whole policy trains; pp > 1: this rank's pipeline stage, a view of the full policy's
          tensors (pipeline.stage_view). Under CP its attention op becomes zigzag ring attention (apply_cp).
  draft   under CP its branch attention becomes ring branch attention and its look-ahead the CP one.
"""

from __future__ import annotations

from torch import nn

from codraft.drafts import DraftModel
from codraft.models import Transformer
from codraft.parallel.cp_draft import apply_cp_to_draft
from codraft.parallel.mesh import ParallelDims
from codraft.parallel.pipeline import stage_view
from codraft.parallel.ring_attention import apply_cp


def parallelize_policy(policy: Transformer, dims: ParallelDims) -> nn.Module:
    """The module this rank trains (the policy itself at pp = 1), ready for this rank's views of a batch."""
    trained = policy if dims.pp == 1 else stage_view(policy, dims.pp_rank, dims.pp)
    return apply_cp(trained, dims)  # cp = 1: unchanged


def parallelize_draft(draft: DraftModel | None, dims: ParallelDims) -> DraftModel | None:
    return apply_cp_to_draft(draft, dims) if draft is not None else None
