"""The speedup of a speculative rollout, measured rather than estimated.

Plain decoding of the rollout's prompts to exactly its row lengths (stop tokens off) does the decode steps the
rollout would have needed without a draft, at the same batch size at every step (rows leave as they did), so
the ratio of the two wall-clock times is the speedup the draft bought on this step, on this machine's state.
At T > 0 the plain run samples other tokens, but the shape of its work is the same.

The same step without a draft (`step_speedup`): its seconds with the rollout swapped for that plain rollout and
the draft's training taken out, each part timed in the step. It compares like for like (the same prompts, row
lengths and policy update), where two whole runs part ways: sampled answers differ between them in length.
"""

from __future__ import annotations

import time

from codraft.models import Transformer
from codraft.rollout.engine import Rollout, generate


def plain_at(model: Transformer, prompts: list[list[int]], lengths: list[int], *, temperature: float,
             top_p: float = 1.0, seed: int | None = None) -> Rollout:
    """Plain decoding of `prompts`, row i to exactly `lengths[i]` tokens (stop tokens off)."""
    return generate(model, prompts, temperature=temperature, top_p=top_p, max_new_tokens=lengths,
                    stop_token_ids=[], seed=seed)


def plain_like(model: Transformer, rollout: Rollout, *, temperature: float, top_p: float = 1.0,
               seed: int | None = None) -> Rollout:
    """Plain decoding of `rollout.prompts`, each row to the length it has in `rollout`."""
    return plain_at(model, rollout.prompts, [len(t) for t in rollout.tokens], temperature=temperature, top_p=top_p,
                    seed=seed)


def measured_speedup(model: Transformer, rollout: Rollout, spec_s: float, *, temperature: float,
                     top_p: float = 1.0, seed: int | None = None) -> dict[str, float]:
    """`rollout` took `spec_s` seconds; time `plain_like` of it and report both and their ratio.

    After a training step the rollout first re-packs the policy's changed weights (0.15-0.17 s a step for
    SmolLM2-135M in the default `codraft train` here), which the plain run right after finds packed. A plain
    rollout at this step would pay that as well, so the plain time is credited with the re-pack the rollout
    measured; the draft's re-pack stays the rollout's own cost."""
    start = time.perf_counter()
    plain = plain_like(model, rollout, temperature=temperature, top_p=top_p, seed=seed)
    plain_s = time.perf_counter() - start
    repack_s = rollout.stats.time_pack_policy_s - plain.stats.time_pack_policy_s
    plain_s += repack_s
    return {"rollout/spec_s": spec_s, "rollout/plain_s": plain_s, "rollout/policy_repack_s": repack_s,
            "rollout/speedup_measured": plain_s / spec_s}


def step_speedup(step_s: float, spec_s: float, plain_s: float, draft_train_s: float) -> dict[str, float]:
    """A training step that took `step_s` seconds, of which `spec_s` in its speculative rollout and `draft_train_s`
    training the draft, against the same step without a draft: plain decoding of its rollout (`plain_s`, timed
    right after it) and the policy's update alone. The policy's update, rewards and the rest do the same work
    with or without a draft (the draft reads the policy's detached outputs), so they are the step's own."""
    plain_step_s = step_s - spec_s - draft_train_s + plain_s
    return {"step/plain_s": plain_step_s, "step/speedup_measured": plain_step_s / step_s}
