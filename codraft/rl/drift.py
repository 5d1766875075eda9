"""Policy drift: how far the policy has moved from the policy the run started with, on fixed inputs.

At step 0 a `DriftProbe` takes a fixed set of held-out prompts, lets the step-0 policy answer them
greedily (once), and keeps that policy's log-softmax over every response token, teacher-forced on
prompt + response. The step-0 policy never changes, so these log-probs stand in for a frozen copy of
it: the probe holds drift_prompts x response tokens x vocab fp32 values, no second model.
`measure(policy)` teacher-forces the same tokens through the current policy (one batched forward)
and returns the mean over response tokens of

    KL(current || step-0) = sum_v p_cur(v) (log p_cur(v) - log p_0(v))

at temperature 1 (the models' own distributions): the direction of GRPO's KL penalty (`kl/ref`).
It is exactly 0 while the weights are those of step 0.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from codraft.config import Config
from codraft.models import Transformer
from codraft.models.linear import unpack_linears
from codraft.rl.tasks import IndexedTask, Problem
from codraft.rollout import generate

# problems this far into a task stream are never trained on (arithmetic, chain); a JSONL dataset has no
# held-out rows, so there the probe's prompts are training prompts
HELD_OUT_START = 1 << 32


@dataclass
class TeacherForced:
    """Right-padded prompt + response rows and the positions whose logits predict response tokens."""

    input_ids: torch.Tensor  # [N, S]
    rows: torch.Tensor  # [R] sequence of each position predicting a response token
    cols: torch.Tensor  # [R] its position in the sequence

    @classmethod
    def build(cls, prompts: list[list[int]], responses: list[list[int]], pad_id: int,
              device: torch.device) -> TeacherForced:
        width = max(len(p) + len(r) for p, r in zip(prompts, responses, strict=True))
        ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
        rows, cols = [], []
        for n, (prompt, response) in enumerate(zip(prompts, responses, strict=True)):
            ids[n, : len(prompt) + len(response)] = torch.tensor(prompt + response)
            rows += [n] * len(response)
            cols += range(len(prompt) - 1, len(prompt) + len(response) - 1)  # a prompt is never empty
        return cls(ids.to(device), torch.tensor(rows, dtype=torch.long, device=device),
                   torch.tensor(cols, dtype=torch.long, device=device))

    @torch.no_grad()
    def logprobs(self, policy: Transformer) -> torch.Tensor:
        """[R, V] fp32 log-softmax of `policy` at every response token. Causal attention over right-padded rows:
        padding after a sequence never reaches its tokens. Plain (non-packed) attention, which parallelisms
        leave as it is."""
        unpack_linears(policy)  # the same F.linear kernel at every call, not a oneDNN copy that may be current
        out = policy(self.input_ids, compute_logits=False)
        return policy.logits(out.hidden[self.rows, self.cols]).float().log_softmax(-1)


class DriftProbe:
    """The step-0 policy's distributions on fixed held-out answers; `measure` compares a later policy with them."""

    def __init__(self, policy: Transformer, prompts: list[list[int]], max_new_tokens: int):
        device = next(policy.parameters()).device
        responses = generate(policy, prompts, temperature=0.0, max_new_tokens=max_new_tokens, seed=0).tokens
        self.batch = TeacherForced.build(prompts, responses, policy.args.pad_token_id or 0, device)
        self.num_tokens = int(self.batch.rows.numel())
        self.reference = self.batch.logprobs(policy)  # [R, V]

    def measure(self, policy: Transformer) -> dict[str, float]:
        """`drift/kl_step0`: mean KL(current || step-0) per response token (NaN if step 0 answered nothing)."""
        start = time.perf_counter()
        current = self.batch.logprobs(policy)
        kl = (current.exp() * (current - self.reference)).sum(-1).mean()  # the mean of none is NaN
        return {"drift/kl_step0": float(kl), "time/drift_s": time.perf_counter() - start}


def drift_probe(cfg: Config, task: IndexedTask, policy: Transformer,
                encode: Callable[[Problem], list[int]]) -> DriftProbe:
    """The probe of `rl.*` for this (step-0) policy: `rl.drift_prompts` problems of `task` far past any run's
    training prompts (HELD_OUT_START), encoded (and length-checked) by `encode`, answered with up to
    `rl.max_new_tokens` tokens."""
    prompts = [encode(task.problem(HELD_OUT_START + i)) for i in range(cfg.rl.drift_prompts)]
    return DriftProbe(policy, prompts, cfg.rl.max_new_tokens)
