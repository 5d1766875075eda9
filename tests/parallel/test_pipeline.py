"""Pipeline-parallel co-training step: pp = 2 and 4 (1F1B and GPipe, more microbatches than stages) reproduce the
losses and the policy and draft gradients of one forward over the whole batch (pp = 1)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from codraft.config import DraftConfig, RLConfig
from codraft.drafts import DraftBatch, build_draft
from codraft.models import load_model
from codraft.parallel.pipeline import (
    StageModule,
    build_stage,
    run_pipeline,
    stage_state_dict,
    sum_tied_grads,
    tap_sources,
)
from codraft.parallel.tapchannel import TapChannel, TapSpec
from codraft.rl.batch import pack_rollouts, per_sequence, split_rollouts, token_logprobs
from codraft.rl.grpo import grpo_loss
from codraft.train.objective import JointObjective
from tests.distributed import run_workers

PRESET = "tiny-llama"  # tied embedding/head: the PP copies of the tied weight must get the summed gradient
# fp32 draft matmuls: under bf16 autocast a microbatch split rounds differently from one forward
RL = RLConfig(draft_weight=0.5, is_correction="tis", draft_matmul_dtype="float32")
DRAFT = DraftConfig(family="eagle3", draft_vocab_size=0, ttt_steps=2)  # full vocab: the split loss is exact


def rollout_batch(n: int = 10, seed: int = 0):
    """A fixed hand-made batch: prompts >= 3 tokens, completions, recorded log-probs, advantages."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, 250, (int(torch.randint(3, 9, (1,), generator=g)),), generator=g).tolist()
               for _ in range(n)]
    completions = [torch.randint(3, 250, (int(torch.randint(1, 7, (1,), generator=g)),), generator=g).tolist()
                   for _ in range(n)]
    logprobs = [(-torch.rand(len(c), generator=g) * 3).tolist() for c in completions]
    advantages = torch.randn(n, generator=g)
    return prompts, completions, logprobs, advantages


def models():
    policy, tokenizer = load_model(PRESET)
    torch.manual_seed(0)
    return policy.train(), build_draft(DRAFT, policy, tokenizer)


def reference_step():
    """pp = 1: one packed forward, RL + lambda * draft loss, one backward."""
    policy, draft = models()
    prompts, completions, logprobs, adv = rollout_batch()
    b = pack_rollouts(prompts, completions, logprobs)
    out = policy(b.input_ids[None], cu_seqlens=b.cu_seqlens, taps=draft.tap_layers)
    logits = out.logits[0]
    rows = b.logprob_index
    lp, mask = per_sequence(token_logprobs(logits[rows], b.input_ids[rows + 1], RL.temperature), b)
    inference_lp, _ = per_sequence(b.inference_logprobs, b)
    rl_loss, _ = grpo_loss(lp, lp.detach(), adv, mask, eps_low=RL.eps_low, eps_high=RL.eps_high,
                           max_tokens=RL.max_new_tokens, inference_logprobs=inference_lp,
                           is_correction=RL.is_correction, is_cap=RL.is_cap)
    draft_loss, _ = draft.loss(DraftBatch(b.input_ids, {i: t[0].detach() for i, t in out.taps.items()},
                                          logits.detach(), b.response_mask, b.cu_seqlens))
    loss = rl_loss + RL.draft_weight * draft_loss
    loss.backward()
    grads = {n: p.grad.clone() for n, p in policy.named_parameters()}
    grads["lm_head.weight"] = policy.lm_head.weight.grad.clone()  # tied: the same tensor as the embedding
    return float(loss.detach()), grads, {n: p.grad.clone() for n, p in draft.named_parameters()}


def _pp_step(rank: int, pp: int, schedule: str, n_mb: int, transport: str):
    policy, draft = models()
    args = policy.args
    stage = build_stage(args, rank, pp)
    stage.load_state_dict(stage_state_dict(policy.state_dict(), stage))
    last = rank == pp - 1
    if last:
        draft.attach(stage)
    mbs, ids = split_rollouts(*rollout_batch(), n_microbatches=n_mb, pad_to=8)
    sources = tap_sources(draft.tap_layers, args.num_layers, pp)
    channel = TapChannel(sources, TapSpec(ids.shape[1], args.hidden_size, torch.float32), schedule=schedule,
                         n_microbatches=n_mb, transport=transport) if sources else None
    objective = JointObjective(RL, draft, mbs) if last else None
    module = StageModule(stage, rank, pp, draft.tap_layers, channel, draft if last else None, objective)
    module.metas = [mb.meta for mb in mbs]
    losses = run_pipeline(module, ids if rank == 0 else None, schedule=schedule, group=None,
                          device=torch.device("cpu"))
    sum_tied_grads(stage, dist.group.WORLD)
    if channel is not None:
        channel.close()
    # numpy, not tensors: tensors cross the result queue as shared memory that dies with the worker
    draft_grads = {n: p.grad.numpy() for n, p in draft.named_parameters()} if last else {}
    loss = float(sum(losses)) if last else None
    return loss, {n: p.grad.numpy() for n, p in stage.named_parameters()}, draft_grads


@pytest.fixture(scope="module")
def reference():
    return reference_step()


@pytest.mark.parametrize(("pp", "schedule", "n_mb", "transport"), [
    (2, "1F1B", 4, "pg"), (2, "GPipe", 3, "auto"), (4, "1F1B", 5, "auto"), (4, "GPipe", 6, "pg"),
    (4, "1F1B", 5, "host_staging"), (2, "GPipe", 3, "host_staging"),  # the blocking baseline must not deadlock
])
def test_pipeline_step_matches_pp1(reference, pp, schedule, n_mb, transport):
    ref_loss, ref_policy, ref_draft = reference
    results = run_workers(_pp_step, pp, schedule, n_mb, transport, timeout=60.0)
    loss, _, draft_grads = results[-1]
    assert loss == pytest.approx(ref_loss, rel=1e-5, abs=1e-6)
    policy_grads = {n: torch.from_numpy(g) for _, grads, _ in results for n, g in grads.items()}
    assert set(policy_grads) == set(ref_policy)
    for name, g in policy_grads.items():
        torch.testing.assert_close(g, ref_policy[name], rtol=1e-4, atol=1e-6, msg=name)
    assert set(draft_grads) == set(ref_draft)
    for name, g in draft_grads.items():
        torch.testing.assert_close(torch.from_numpy(g), ref_draft[name], rtol=1e-4, atol=1e-6, msg=name)
