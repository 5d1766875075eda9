"""Batched generation: greedy equivalences, ragged rows, log-probs, bad input."""

import logging

import pytest
import torch

from codraft.models.linear import native_bf16
from codraft.rollout import Proposal, SamplingParams, SpeculationController, generate
from codraft.rollout.drafters import NgramDrafter, PreviousRolloutDrafter
from codraft.rollout.sampling import probabilities
from codraft.rollout.verify import verify, verify_greedy
from tests.rollout.conftest import SkewedDrafter, Truncating, tiny_model

PROMPTS = [[3, 4, 5, 6, 3, 4, 5], [7, 8, 9], [10, 11, 12, 13, 14, 15, 10, 11, 12, 13], [20]]


def model_for_greedy():
    return tiny_model(vocab_size=48, sharpen=3.0, tie_word_embeddings=False)


@pytest.mark.parametrize(
    "drafter",
    [NgramDrafter(), SkewedDrafter(48), SkewedDrafter(48, point_mass=True)],
    ids=["ngram", "skewed-probs", "skewed-point-mass"],
)
def test_greedy_speculative_equals_greedy_plain(drafter):
    model = model_for_greedy()
    plain = generate(model, PROMPTS, temperature=0, max_new_tokens=24, stop_token_ids=[1, 2])
    spec = generate(
        model,
        PROMPTS,
        drafter=drafter,
        num_speculative_tokens=3,
        temperature=0,
        max_new_tokens=24,
        stop_token_ids=[1, 2],
    )
    assert spec.tokens == plain.tokens
    assert spec.finish_reasons == plain.finish_reasons
    assert spec.stats.target_forwards > 0


def test_ragged_batch_equals_rows_alone():
    model = model_for_greedy()
    stops = [5, 9, 30]  # rows stop at different times
    kw = dict(drafter=NgramDrafter(), num_speculative_tokens=4, temperature=0, max_new_tokens=16, stop_token_ids=stops)
    batch = generate(model, PROMPTS, **kw)
    for i, prompt in enumerate(PROMPTS):
        alone = generate(model, [prompt], **kw)
        assert batch.tokens[i] == alone.tokens[0]
        assert batch.finish_reasons[i] == alone.finish_reasons[0]
        torch.testing.assert_close(torch.tensor(batch.logprobs[i]), torch.tensor(alone.logprobs[0]))
    assert len(set(map(len, batch.tokens))) > 1, "rows should finish at different times"


@pytest.mark.parametrize("params", [SamplingParams(1.0), SamplingParams(0.7, top_p=0.9), SamplingParams(0.0)])
def test_logprobs_equal_a_fresh_full_forward(params):
    model = tiny_model(vocab_size=48, sharpen=2.0, tie_word_embeddings=False)
    out = generate(
        model,
        PROMPTS,
        drafter=SkewedDrafter(48),
        num_speculative_tokens=3,
        max_new_tokens=12,
        temperature=params.temperature,
        top_p=params.top_p,
        stop_token_ids=[1],
        seed=3,
    )
    for prompt, gen, logp in zip(PROMPTS, out.tokens, out.logprobs, strict=True):
        seq = torch.tensor([prompt + gen])
        with torch.no_grad():
            p = probabilities(model(seq).logits[0, len(prompt) - 1 : -1], params)
        ref = p.gather(-1, torch.tensor(gen)[:, None]).squeeze(-1).log()
        torch.testing.assert_close(torch.tensor(logp), ref, atol=1e-5, rtol=1e-5)


def test_stop_token_ends_a_row_and_length_caps_it():
    model = model_for_greedy()
    free = generate(model, [PROMPTS[1]], temperature=0, max_new_tokens=10, stop_token_ids=[])
    stop = free.tokens[0][3]
    out = generate(model, [PROMPTS[1]], drafter=NgramDrafter(), temperature=0, max_new_tokens=10, stop_token_ids=[stop])
    cut = free.tokens[0].index(stop) + 1
    assert out.tokens[0] == free.tokens[0][:cut] and out.finish_reasons == ["stop"]
    assert free.finish_reasons == ["length"] and len(free.tokens[0]) == 10


@pytest.mark.parametrize("drafter", [None, NgramDrafter(), SkewedDrafter(48)], ids=["plain", "ngram", "skewed"])
@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "t1"])
def test_per_row_limits_give_those_lengths_with_stops_off(drafter, temperature):
    model = model_for_greedy()
    limits = [5, 1, 12, 3]
    out = generate(model, PROMPTS, drafter=drafter, num_speculative_tokens=4, temperature=temperature,
                   max_new_tokens=limits, stop_token_ids=[], seed=0)
    assert [len(t) for t in out.tokens] == limits and [len(lp) for lp in out.logprobs] == limits
    assert out.finish_reasons == ["length"] * len(PROMPTS) and out.stats.tokens_generated == sum(limits)


@pytest.mark.parametrize("drafter", [None, NgramDrafter()], ids=["plain", "ngram"])
def test_greedy_per_row_limits_cut_an_unlimited_run(drafter):
    model = model_for_greedy()
    kw = dict(drafter=drafter, num_speculative_tokens=4, temperature=0, stop_token_ids=[])
    full = generate(model, PROMPTS, max_new_tokens=20, **kw)
    limits = [7, 2, 20, 11]
    cut = generate(model, PROMPTS, max_new_tokens=limits, **kw)
    assert cut.tokens == [t[:n] for t, n in zip(full.tokens, limits, strict=True)]


def test_per_row_limits_and_stop_tokens_end_a_row_at_whichever_comes_first():
    model = model_for_greedy()
    free = generate(model, PROMPTS[:2], temperature=0, max_new_tokens=10, stop_token_ids=[])
    stop = free.tokens[0][3]
    assert stop not in free.tokens[1][:2]
    out = generate(model, PROMPTS[:2], drafter=NgramDrafter(), temperature=0, max_new_tokens=[10, 2],
                   stop_token_ids=[stop])
    assert out.tokens == [free.tokens[0][: free.tokens[0].index(stop) + 1], free.tokens[1][:2]]
    assert out.finish_reasons == ["stop", "length"]


def test_previous_rollout_drafter_replays_the_last_completion():
    model = model_for_greedy()
    first = generate(model, PROMPTS, temperature=0, max_new_tokens=20, stop_token_ids=[])
    drafter = PreviousRolloutDrafter()
    drafter.remember(PROMPTS, first.tokens)
    again = generate(
        model, PROMPTS, drafter=drafter, num_speculative_tokens=6, temperature=0, max_new_tokens=20, stop_token_ids=[]
    )
    assert again.tokens == first.tokens
    assert again.stats.acceptance_length == pytest.approx(7.0, abs=1.5)  # nearly every draft accepted


def test_adaptive_speculation_keeps_greedy_output():
    model = model_for_greedy()
    plain = generate(model, PROMPTS, temperature=0, max_new_tokens=24)
    spec = generate(
        model,
        PROMPTS,
        drafter=NgramDrafter(),
        num_speculative_tokens=4,
        temperature=0,
        max_new_tokens=24,
        adaptive=True,
    )
    assert spec.tokens == plain.tokens
    assert set(spec.stats.k_chosen) <= set(range(5))


def test_rows_verifying_fewer_drafts_than_others_keep_greedy_output():
    """Per-row draft lengths from the draft's confidence: steps whose rows feed 0-4 drafts (the forward runs
    only the tokens fed) emit exactly plain decoding's tokens."""
    model = model_for_greedy()
    plain = generate(model, PROMPTS, temperature=0, max_new_tokens=24)
    controller = Truncating(k=4)
    spec = generate(model, PROMPTS, drafter=SkewedDrafter(model.args.vocab_size, point_mass=True),
                    num_speculative_tokens=4, temperature=0, max_new_tokens=24, adaptive=controller)
    assert spec.tokens == plain.tokens
    assert any(f not in (len(PROMPTS), 5 * len(PROMPTS)) for f in controller.fed[1:])  # ragged steps ran


def test_the_controller_sees_each_live_rows_remaining_tokens_only_where_those_are_its_length():
    """With stop tokens off a row runs to its limit, so the batch's last row is known (the controller's `tail`);
    with stop tokens on a row's length is its own, and the controller is told nothing."""

    class Recording(SpeculationController):
        def __init__(self):
            super().__init__(3)
            self.seen = []

        def choose(self, rows, remaining=None):
            self.seen.append(remaining)
            return super().choose(rows, remaining)

    off, on = Recording(), Recording()
    out = generate(model_for_greedy(), PROMPTS, drafter=NgramDrafter(), num_speculative_tokens=3, temperature=0,
                   max_new_tokens=[5, 9, 12, 3], stop_token_ids=[], adaptive=off)
    assert off.seen[0] == [4, 8, 11, 2]  # each row's limit less the prefill's token
    assert all(len(r) <= len(PROMPTS) and min(r) >= 1 for r in off.seen)
    assert len(off.seen) == out.stats.target_forwards
    generate(model_for_greedy(), PROMPTS, drafter=NgramDrafter(), num_speculative_tokens=3, temperature=0,
             max_new_tokens=12, adaptive=on)
    assert on.seen and all(r is None for r in on.seen)


def test_proposals_after_a_plain_step_are_counted_as_backlog():
    """The first proposal of a call absorbs the prompt and one after a plain step the tokens it committed:
    their time is kept apart (prefill-like work), and the controller does not learn the draft's cost from it."""
    model = model_for_greedy()
    fixed = generate(model, PROMPTS, drafter=SkewedDrafter(48), num_speculative_tokens=3, max_new_tokens=12, seed=0)
    assert fixed.stats.backlog_proposals == 1
    assert 0 < fixed.stats.time_draft_backlog_s < fixed.stats.time_draft_s

    class Alternating(SpeculationController):
        def __init__(self):
            super().__init__(3)
            self.calls, self.draft_seen = 0, []

        def choose(self, rows, remaining=None):
            self.calls += 1
            return 2 * (self.calls % 2)  # 2, 0, 2, 0, ...: every proposal follows a plain step

        def observe(self, k, reached, accepted, rows, verify_s, draft_s, fed=None):
            self.draft_seen.append(draft_s)
            super().observe(k, reached, accepted, rows, verify_s, draft_s, fed)

    c = Alternating()
    out = generate(model, PROMPTS, drafter=SkewedDrafter(48), num_speculative_tokens=3, max_new_tokens=12, seed=0,
                   adaptive=c)
    assert out.stats.backlog_proposals == sum(1 for k in out.stats.k_chosen if k)
    assert c.draft_seen[0] is None and c.draft_s == {}


class Broken(SkewedDrafter):
    def __init__(self, vocab_size, fault):
        super().__init__(vocab_size)
        self.fault = fault

    def propose(self, pending, k, probe_rows=None):
        p = super().propose(pending, k)
        if self.fault == "nan":
            p.probs[:, 0, 0] = float("nan")
        elif self.fault == "vocab":
            p.tokens[:, 0] = 10_000
        elif self.fault == "shape":
            return Proposal(tokens=p.tokens[:, :1].T, lengths=p.lengths, probs=None)
        elif self.fault == "zero-sum":
            p.probs.zero_()
        elif self.fault == "confidence-nan":
            p.confidence[:, 0] = float("nan")
        elif self.fault == "confidence-shape":
            p.confidence = p.confidence[:, :1]
        elif self.fault == "off-draft-vocab":  # q over a reduced vocab that does not hold the proposed token
            vocab = torch.tensor([t for t in range(p.probs.shape[-1]) if t != int(p.tokens[0, 0])])
            return Proposal(p.tokens, p.lengths, p.probs[..., vocab].softmax(-1), vocab=vocab)
        return p


@pytest.mark.parametrize("fault", ["nan", "vocab", "shape", "zero-sum", "off-draft-vocab", "confidence-nan",
                                   "confidence-shape"])
def test_malformed_proposals_fall_back_to_plain_decoding(fault, caplog):
    model = model_for_greedy()
    plain = generate(model, PROMPTS, temperature=0, max_new_tokens=8)
    with caplog.at_level(logging.WARNING):  # with the controller, which reads the confidence
        out = generate(model, PROMPTS, drafter=Broken(48, fault), temperature=0, max_new_tokens=8,
                       adaptive=Truncating(k=4))
    assert out.tokens == plain.tokens
    assert out.stats.malformed_proposals > 0
    assert "drafter proposal rejected" in caplog.text


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(prompts=[]), "prompts is empty"),
        (dict(prompts=[[1, 2], []]), r"prompts\[1\] is empty"),
        (dict(prompts=[[1] * 600]), r"prompts\[0\] has 600 tokens"),
        (dict(prompts=[[1, 99]]), "outside"),
        (dict(num_speculative_tokens=-1), "num_speculative_tokens must be >= 0"),
        (dict(temperature=-0.5), "temperature must be >= 0"),
        (dict(top_p=0.0), r"top_p must be in \(0, 1\]"),
        (dict(top_p=1.5), r"top_p must be in \(0, 1\]"),
        (dict(max_new_tokens=0), "max_new_tokens must be >= 1"),
        (dict(max_new_tokens=[4, 4]), "max_new_tokens has 2 limits for 1 prompts"),
        (dict(prompts=[[3], [4]], max_new_tokens=[4, 0]), r"max_new_tokens\[1\] must be >= 1"),
        (dict(prompts=[[3], [1] * 500], max_new_tokens=[100, 10]), r"prompts\[1\] has 500 tokens"),
    ],
)
def test_bad_input_is_a_clear_value_error(kwargs, message):
    model = model_for_greedy()
    call = dict(prompts=[[3, 4]], drafter=NgramDrafter()) | kwargs
    with pytest.raises(ValueError, match=message):
        generate(model, call.pop("prompts"), **call)


@pytest.mark.parametrize("params", [SamplingParams(0.0), SamplingParams(1.0)], ids=["greedy", "t1"])
def test_packed_weights_give_the_reference_paths_tokens_and_logprobs(params):
    """The fast path (oneDNN-packed linears, greedy verification on argmax ids) against the plain one."""
    model = tiny_model(vocab_size=48, sharpen=2.0, tie_word_embeddings=False)
    kw = dict(drafter=SkewedDrafter(48), num_speculative_tokens=3, temperature=params.temperature,
              max_new_tokens=16, stop_token_ids=[], seed=5)
    fast = generate(model, PROMPTS, **kw)
    kw["drafter"] = SkewedDrafter(48)
    reference = generate(model, PROMPTS, packed_weights=False, **kw)
    assert fast.tokens == reference.tokens
    for a, b in zip(fast.logprobs, reference.logprobs, strict=True):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), rtol=1e-4, atol=1e-5)


@pytest.mark.skipif(not native_bf16(), reason="bf16 copies are used only where the CPU has bf16 arithmetic")
def test_bf16_rollout_matmuls_keep_greedy_speculation_equal_to_plain_decoding():
    """`model.inference_dtype=bfloat16`: the policy's linears run on bf16 copies, its head on fp32 ones (greedy
    equality on this tiny model; SmolLM2's bf16 rollouts are shape-invariant with AMX or on codraft's kernel, not on
    oneDNN's without AMX: models/linear.py)."""
    model = model_for_greedy()
    model.inference_dtype = torch.bfloat16
    plain = generate(model, PROMPTS, temperature=0, max_new_tokens=24, stop_token_ids=[])
    assert model.layers["0"].mlp.down_proj.packed.weight.dtype == torch.bfloat16
    assert model.lm_head.packed.weight.dtype == torch.float32
    for drafter in (NgramDrafter(), SkewedDrafter(48)):
        spec = generate(model, PROMPTS, drafter=drafter, num_speculative_tokens=3, temperature=0, max_new_tokens=24,
                        stop_token_ids=[])
        assert spec.tokens == plain.tokens


def test_greedy_verification_equals_verification_against_point_masses():
    g = torch.Generator().manual_seed(0)
    B, k, V = 64, 4, 6
    logits = torch.randn(B, k + 1, V, generator=g)
    drafts = torch.randint(0, V, (B, k), generator=g)
    drafts[:16] = logits[:16, :k].argmax(-1)  # some rows accept everything
    num_drafts = torch.randint(0, k + 1, (B,), generator=g)
    fast = verify_greedy(drafts, num_drafts, logits.argmax(-1))
    reference = verify(drafts, num_drafts, None, None, probabilities(logits, SamplingParams(0.0)), g)
    assert torch.equal(fast.num_accepted, reference.num_accepted)
    assert torch.equal(fast.next_token, reference.next_token)


def test_sparse_draft_distributions_verify_as_their_full_vocab_expansion():
    g = torch.Generator().manual_seed(1)
    B, k, V = 32, 3, 10
    vocab = torch.tensor([1, 4, 5, 8])
    q_sparse = torch.rand(B, k, vocab.numel(), generator=g).softmax(-1)
    q_full = torch.zeros(B, k, V).index_copy_(-1, vocab, q_sparse)
    drafts = vocab[torch.randint(0, vocab.numel(), (B, k), generator=g)]
    target = torch.rand(B, k + 1, V, generator=g).softmax(-1)
    num_drafts = torch.full((B,), k)
    sparse = verify(drafts, num_drafts, q_sparse, vocab, target, torch.Generator().manual_seed(9))
    full = verify(drafts, num_drafts, q_full, None, target, torch.Generator().manual_seed(9))
    assert torch.equal(sparse.num_accepted, full.num_accepted) and torch.equal(sparse.next_token, full.next_token)
    assert (sparse.num_accepted < k).any() and (sparse.num_accepted > 0).any()


def test_an_untrained_learned_draft_with_adaptive_k_keeps_greedy_output():
    """(How rarely it speculates is timing-driven: measured by `codraft bench rollout`, and with synthetic
    timings in test_adaptive.py.)"""
    from codraft.config import DraftConfig
    from codraft.drafts import build_draft

    model = model_for_greedy()
    draft = build_draft(DraftConfig(family="eagle3", draft_vocab_size=0), model).eval()
    plain = generate(model, PROMPTS, temperature=0, max_new_tokens=40, stop_token_ids=[])
    spec = generate(model, PROMPTS, drafter=draft.drafter(), num_speculative_tokens=4, temperature=0,
                    max_new_tokens=40, stop_token_ids=[], adaptive=True)
    assert spec.tokens == plain.tokens


def test_a_prompt_repeated_across_rows_is_prefilled_once_and_each_row_decodes_as_alone():
    """A GRPO group repeats its prompt: the prefill runs each distinct prompt once, and every row's cache, first
    token and draft state are then its own (rows sample apart at T > 0; greedy rows equal the prompt alone)."""
    from codraft.config import DraftConfig
    from codraft.drafts import build_draft

    model = model_for_greedy()
    draft = build_draft(DraftConfig(family="eagle3", draft_vocab_size=0), model).eval()
    prompts = [PROMPTS[0], PROMPTS[2], PROMPTS[0], PROMPTS[0], PROMPTS[2]]
    prefill_rows = []
    hook = model.register_forward_pre_hook(lambda _, args: prefill_rows.append(args[0].shape) if args else None)
    try:
        greedy = generate(model, prompts, drafter=draft.drafter(), num_speculative_tokens=3, temperature=0,
                          max_new_tokens=20, stop_token_ids=[])
    finally:
        hook.remove()
    assert prefill_rows[0] == (2, len(PROMPTS[2]))  # the two distinct prompts, padded to the longer
    for prompt, tokens in zip(prompts, greedy.tokens, strict=True):
        assert tokens == generate(model, [prompt], temperature=0, max_new_tokens=20, stop_token_ids=[]).tokens[0]
    sampled = generate(model, prompts, drafter=draft.drafter(), num_speculative_tokens=3, temperature=1.0,
                       max_new_tokens=20, stop_token_ids=[], seed=0)
    assert len({tuple(sampled.tokens[i]) for i in (0, 2, 3)}) > 1  # one prompt's rows draw their own tokens
    for prompt, tokens, logprobs in zip(prompts, sampled.tokens, sampled.logprobs, strict=True):
        with torch.no_grad():
            logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1: -1]
        expected = logits.log_softmax(-1).gather(-1, torch.tensor(tokens)[:, None]).squeeze(-1)
        torch.testing.assert_close(torch.tensor(logprobs), expected, atol=1e-4, rtol=1e-4)


def test_a_probe_verifies_the_drafts_of_its_first_rows_only_and_keeps_greedy_output():
    class AlwaysProbing(SpeculationController):
        def __init__(self):
            super().__init__(2, probe_rows=2)
            self.steps: list[tuple[int, list[int]]] = []  # (live rows, reached) of each step

        def choose(self, rows, remaining=None):
            self.probing = True
            return 2

        def observe(self, k, reached, accepted, rows, verify_s, draft_s, fed=None):
            self.steps.append((rows, reached))
            super().observe(k, reached, accepted, rows, verify_s, draft_s, fed)

    model = model_for_greedy()
    plain = generate(model, PROMPTS, temperature=0, max_new_tokens=12, stop_token_ids=[])
    c = AlwaysProbing()
    spec = generate(model, PROMPTS, drafter=SkewedDrafter(model.args.vocab_size, point_mass=True),
                    num_speculative_tokens=2, temperature=0, max_new_tokens=12, stop_token_ids=[], adaptive=c)
    assert spec.tokens == plain.tokens
    # 4 rows, 2 sampled: at most 2 rows reach draft 0 (rows without a draft are not counted as rejections)
    assert all(reached[0] <= min(rows, 2) for rows, reached in c.steps) and spec.stats.draft_tokens_proposed
    assert spec.stats.draft_tokens_proposed <= 2 * 2 * len(c.steps)


def test_the_proposal_after_a_probe_of_some_rows_is_not_learned_as_a_steady_draft_cost():
    class ProbeThenSpeculate(SpeculationController):
        def __init__(self):
            super().__init__(2, probe_rows=2, truncate=False)
            self.calls: list[tuple[bool, float | None]] = []  # (probing, draft_s) of each speculative step

        def choose(self, rows, remaining=None):
            self.probing = not self.calls
            return 2

        def observe(self, k, reached, accepted, rows, verify_s, draft_s, fed=None):
            self.calls.append((self.probing, draft_s))
            super().observe(k, reached, accepted, rows, verify_s, draft_s, fed)

    model = model_for_greedy()
    c = ProbeThenSpeculate()
    generate(model, PROMPTS, drafter=SkewedDrafter(model.args.vocab_size, point_mass=True), num_speculative_tokens=2,
             temperature=0, max_new_tokens=8, stop_token_ids=[], adaptive=c)
    # the probe (2 of 4 rows) and the proposal after it, which absorbs the other rows' backlog, teach no draft cost
    assert [p for p, _ in c.calls[:2]] == [True, False] and c.calls[0][1] is None and c.calls[1][1] is None
    assert c.calls[2][1] is not None
