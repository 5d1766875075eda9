"""EAGLE-3: TTT loss against an unrolled reference, lossless and consistent proposals, export, vocab, bad input."""

import json
import math

import pytest
import torch
import torch.nn.functional as F

from codraft.config import DraftConfig
from codraft.drafts.base import DraftBatch
from codraft.drafts.eagle3 import Eagle3Draft, default_tap_layers
from codraft.drafts.export import export_draft, load_draft
from codraft.drafts.vocab import build_draft_vocab, count_tokens
from codraft.models import ModelArgs, Transformer
from codraft.models.linear import int8_packing_available, packing_available
from codraft.models.rope import apply_rotary
from codraft.rollout import SamplingParams, generate
from codraft.rollout.sampling import probabilities
from tests.rollout.conftest import tiny_model
from tests.rollout.test_lossless import ALPHA, chi_square_pvalue, exact_joint, sampled_counts

V = 48
LENS = [7, 12, 2, 9]  # packed sequences of unequal lengths (one too short to predict anything)


def policy_model(dtype=torch.float64, **overrides) -> Transformer:
    torch.manual_seed(0)
    args = dict(
        vocab_size=V,
        hidden_size=32,
        intermediate_size=64,
        num_layers=6,
        num_heads=4,
        num_kv_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    return Transformer(ModelArgs(**(args | overrides))).to(dtype).eval()


def make_draft(policy: Transformer, seed: int = 1, **cfg) -> Eagle3Draft:
    """A draft with every weight random (norms too, so a misplaced norm cannot hide) and a 32-token vocab."""
    g = torch.Generator().manual_seed(seed)
    counts = torch.randint(0, 100, (policy.args.vocab_size,), generator=g)
    cfg = {"draft_vocab_size": 32} | cfg
    draft = Eagle3Draft(DraftConfig(**cfg), policy.args, token_counts=counts).to(policy.lm_head.weight.dtype)
    with torch.no_grad():
        for name, p in draft.named_parameters():
            noise = torch.randn(p.shape, generator=g, dtype=p.dtype)
            p.copy_(1 + 0.2 * noise if "norm" in name else p + 0.1 * noise)
    return draft.attach(policy)


def packed_batch(policy: Transformer, draft: Eagle3Draft, seed: int = 2, detach: bool = True) -> DraftBatch:
    g = torch.Generator().manual_seed(seed)
    T = sum(LENS)
    ids = torch.randint(0, V, (T,), generator=g)
    cu = torch.tensor([0, *LENS]).cumsum(0)
    loss_mask = torch.rand(T, generator=g) > 0.25  # a few prompt tokens among the responses
    with torch.set_grad_enabled(not detach):
        out = policy(ids[None], cu_seqlens=cu, taps=draft.tap_layers)
    return DraftBatch(ids, {i: t[0] for i, t in out.taps.items()}, out.logits[0], loss_mask, cu)


# --- the reference: TTT unrolled step by step with one explicit mask over [K0 ; chain keys] per step ---


def rms(x, weight, eps):
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def reference_loss(draft: Eagle3Draft, batch: DraftBatch) -> torch.Tensor:
    a, m, att = draft.layer_args, draft.midlayer, draft.midlayer.self_attn
    H, Hkv, D, eps = a.num_heads, a.num_kv_heads, a.head_dim, a.rms_norm_eps
    ids, cu = batch.input_ids.tolist(), batch.cu_seqlens.tolist()
    T = len(ids)
    seq = [i for i in range(len(cu) - 1) for _ in range(cu[i], cu[i + 1])]
    pos = torch.tensor([t - cu[seq[t]] for t in range(T)])
    vocab = [v for v in range(V) if draft.t2d[v]]  # draft id -> target id
    to_draft = {v: i for i, v in enumerate(vocab)}

    hidden = torch.cat([batch.taps[i] for i in draft.tap_layers], -1) @ draft.fusion.fc.weight.T
    keys, values, total = [], [], 0.0
    for s in range(draft.cfg.ttt_steps):
        tokens = torch.tensor([ids[min(t + 1 + s, T - 1)] for t in range(T)])
        x = torch.cat(
            [rms(draft._embed[tokens], m.input_layernorm.weight, eps), rms(hidden, m.hidden_norm.weight, eps)], -1
        )
        cos, sin = draft.rotary(pos + s, x.dtype)
        q = apply_rotary((x @ att.q_proj.weight.T).view(T, H, D), cos, sin)
        keys.append(apply_rotary((x @ att.k_proj.weight.T).view(T, Hkv, D), cos, sin))
        values.append((x @ att.v_proj.weight.T).view(T, Hkv, D))
        mask = torch.zeros(T, (s + 1) * T, dtype=torch.bool)  # keys: step 0 (all positions), then steps 1..s
        for t in range(T):
            for u in range(T):
                mask[t, u] = seq[u] == seq[t] and u <= t
            for j in range(1, s + 1):
                mask[t, j * T + t] = True
        k = torch.cat(keys).repeat_interleave(H // Hkv, 1)
        v = torch.cat(values).repeat_interleave(H // Hkv, 1)
        scores = torch.einsum("thd,uhd->htu", q, k) / math.sqrt(D)
        probs = scores.masked_fill(~mask, float("-inf")).softmax(-1)
        h = hidden + torch.einsum("htu,uhd->thd", probs, v).reshape(T, H * D) @ att.o_proj.weight.T
        n = rms(h, m.post_attention_layernorm.weight, eps)
        mlp = m.mlp
        hidden = h + (F.silu(n @ mlp.gate_proj.weight.T) * (n @ mlp.up_proj.weight.T)) @ mlp.down_proj.weight.T
        logits = rms(hidden, draft.norm.weight, eps) @ draft.lm_head.weight.T

        losses = []
        for t in range(T):
            g = t + 2 + s  # the token position t predicts at step s
            if g >= cu[seq[t] + 1] or not batch.loss_mask[g] or not draft.t2d[batch.policy_logits[g - 1].argmax()]:
                continue
            log_q = logits[t].log_softmax(-1)
            p = batch.policy_logits[g - 1, vocab].softmax(-1)
            if draft.cfg.loss == "soft_ce":
                losses.append(-(p * log_q).sum())
            elif draft.cfg.loss == "tv":
                losses.append(0.5 * (p - log_q.exp()).abs().sum())
            elif ids[g] in to_draft:  # hard_ce: only targets the draft can name
                losses.append(-log_q[to_draft[ids[g]]])
        if losses:
            total = total + draft.cfg.ttt_decay**s * torch.stack(losses).mean()
    return total


@pytest.mark.parametrize(
    "impl,kind", [("fused", "soft_ce"), ("dense", "soft_ce"), ("fused", "hard_ce"), ("fused", "tv")]
)
def test_ttt_loss_and_grads_match_unrolled_reference(impl, kind):
    policy = policy_model()
    draft = make_draft(policy, loss=kind)
    draft.attention_impl = impl
    batch = packed_batch(policy, draft)

    loss, metrics = draft.loss(batch)
    grads = torch.autograd.grad(loss, list(draft.parameters()))
    ref = reference_loss(draft, batch)
    ref_grads = torch.autograd.grad(ref, list(draft.parameters()))

    torch.testing.assert_close(loss.double(), ref.double(), rtol=1e-5, atol=1e-7)
    for (name, _), g, r in zip(draft.named_parameters(), grads, ref_grads, strict=True):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-7, msg=lambda m, n=name: f"{n}: {m}")
    assert set(metrics) >= {"loss/draft", "draft/acc_pos_2", "draft/expected_accept_pos_0"}
    assert metrics["loss/draft"] == pytest.approx(loss.item())
    assert all(0 <= metrics[f"draft/expected_accept_pos_{s}"] <= 1 for s in range(3))


def test_policy_gets_no_gradient_from_the_draft_loss():
    policy = policy_model().train()
    draft = make_draft(policy)
    batch = packed_batch(policy, draft, detach=False)  # even undetached taps/logits must not carry gradient back
    assert batch.taps[draft.tap_layers[0]].requires_grad
    loss, _ = draft.loss(batch)
    loss.backward()
    assert all(p.grad is None for p in policy.parameters())
    assert all(p.grad is not None for p in draft.parameters())
    names = set(dict(draft.named_parameters())) | set(draft.state_dict())
    assert not any("embed" in n for n in names), "the embedding is borrowed, not owned"


def test_default_taps_of_deep_policies():
    assert default_tap_layers(32) == [1, 15, 28]
    assert default_tap_layers(7) == [1, 2, 3]


@pytest.mark.parametrize("layers", [3, 4, 5, 6, 7, 8, 12, 32, 80])
def test_default_taps_are_three_ascending_layers_of_any_policy_with_three(layers):
    """SpecForge, SGLang and vLLM build EAGLE-3's fc for exactly 3 taps, concatenated in ascending order."""
    taps = default_tap_layers(layers)
    assert len(taps) == 3 and taps == sorted(set(taps)) and taps[0] >= 0 and taps[-1] < layers


def test_default_taps_of_shallow_policies():
    assert default_tap_layers(3) == [0, 1, 2]
    assert default_tap_layers(4) == [1, 2, 3]
    assert default_tap_layers(6) == [1, 3, 5]  # low, middle, last below 7 layers
    assert default_tap_layers(2) == [0, 1]  # every layer of a policy too shallow for three


def test_bad_config():
    args = policy_model().args
    with pytest.raises(ValueError, match="draft.tap_layers' must be strictly ascending: SGLang and vLLM"):
        Eagle3Draft(DraftConfig(tap_layers=[2, 0, 1]), args)
    with pytest.raises(ValueError, match="ttt_steps"):
        Eagle3Draft(DraftConfig(ttt_steps=0), args)
    with pytest.raises(ValueError, match="tap_layers"):
        Eagle3Draft(DraftConfig(tap_layers=[1, 6]), args)
    with pytest.raises(ValueError, match="token_counts"):
        Eagle3Draft(DraftConfig(), args, token_counts=torch.ones(V + 1))


def test_draft_vocab_from_counts():
    counts = count_tokens([[4, 0, 2, 0], torch.tensor([2, 4, 4, 1])], vocab_size=6)
    assert counts.tolist() == [2, 1, 2, 0, 3, 0]
    d2t, t2d = build_draft_vocab(counts, 3)  # 4 (3x), then 0 and 2 (2x each)
    assert t2d.tolist() == [True, False, True, False, True, False]
    assert (torch.arange(3) + d2t).tolist() == [0, 2, 4] and d2t.dtype == torch.int64
    d2t, t2d = build_draft_vocab(torch.zeros(6), 2)  # ties: lower ids first
    assert t2d.nonzero().flatten().tolist() == [0, 1]
    for size in (0, 10):  # 0 and anything at least the target vocab mean the whole vocab
        d2t, t2d = build_draft_vocab(counts, size)
        assert t2d.all() and not d2t.any()
    with pytest.raises(ValueError, match="outside"):
        count_tokens([[6]], vocab_size=6)


# --- inference ---


def test_incremental_proposals_equal_ttt_over_the_same_history():
    """After ragged commits, chain step s of a proposal equals TTT step s at the last committed position
    of a fresh, non-incremental forward over the same history (absorb, KV cache and chain are right)."""
    policy = policy_model()
    draft = make_draft(policy)
    params, k = SamplingParams(1.0), 3
    prompts = [[3, 4, 5, 6, 7], [9, 8, 7, 6, 5, 4, 3, 2, 1], [11, 12, 13]]
    B = len(prompts)
    ids = torch.zeros(B, 9, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, : len(p)] = torch.tensor(p)
    cache = policy.new_cache(B, 48)
    with torch.no_grad():
        out = policy(ids, cache=cache, taps=draft.tap_layers)
    cache.lengths.copy_(torch.tensor([len(p) for p in prompts]))
    drafter = draft.drafter()
    drafter.start(prompts, out.taps, params, cache.max_len)
    history = [list(p) for p in prompts]
    torch.manual_seed(0)
    pending = torch.tensor([20, 21, 22])
    for kept in ([1, 4, 2], [3, 1, 4], [2, 2, 1]):
        proposal = drafter.propose(pending, k)
        assert proposal.lengths.tolist() == [k] * B
        for b in range(B):
            n = len(history[b])
            seq = torch.tensor(history[b] + [int(pending[b])] + proposal.tokens[b, : k - 1].tolist())
            with torch.no_grad():
                taps = policy(seq[None], taps=draft.tap_layers).taps
                cu, positions = torch.tensor([0, len(seq)]), torch.arange(len(seq))
                logits = draft.ttt_forward(draft.fuse(taps)[0], seq, cu, positions, steps=k)
            for s in range(k):
                expected = probabilities(logits[s][n - 1 : n], params)[0]  # over the draft vocab
                torch.testing.assert_close(proposal.probs[b, s], expected, atol=1e-6, rtol=1e-5)
                assert torch.equal(proposal.vocab, draft.draft_ids())
        feed = torch.cat([pending[:, None], proposal.tokens], 1)
        kept = torch.tensor(kept)
        with torch.no_grad():
            fwd = policy(feed, cache=cache, taps=draft.tap_layers)
        cache.advance(kept)
        drafter.commit(feed, kept, fwd.taps)
        for b in range(B):
            history[b] += feed[b, : kept[b]].tolist()
        pending = torch.randint(0, V, (B,))
    assert drafter.state.cache.lengths.tolist() == drafter.state.absorbed.tolist()


@pytest.fixture(scope="module")
def trained():
    """A fp32 policy and a draft trained for a few steps on the policy's own greedy text (so drafts get accepted)."""
    policy = tiny_model(vocab_size=V, sharpen=3.0, tie_word_embeddings=False, num_layers=6)
    draft = make_draft(policy, draft_vocab_size=0)
    prompts = [[i, (3 * i) % V, (7 * i + 1) % V] for i in range(2, 14)]
    rollout = generate(policy, prompts, temperature=0, max_new_tokens=20, stop_token_ids=[])
    seqs = [p + t for p, t in zip(prompts, rollout.tokens, strict=True)]
    ids = torch.tensor([x for s in seqs for x in s])
    cu = torch.tensor([0] + [len(s) for s in seqs]).cumsum(0)
    mask = torch.tensor([j >= len(p) for p, s in zip(prompts, seqs, strict=True) for j in range(len(s))])
    with torch.no_grad():
        out = policy(ids[None], cu_seqlens=cu, taps=draft.tap_layers)
    batch = DraftBatch(ids, {i: t[0] for i, t in out.taps.items()}, out.logits[0], mask, cu)
    opt = torch.optim.Adam(draft.parameters(), lr=2e-2)
    history = []
    for _ in range(30):
        loss, metrics = draft.loss(batch)
        history.append(metrics)
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert history[-1]["loss/draft"] < history[0]["loss/draft"]
    assert history[0]["draft/acc_pos_0"] < 0.1 < 0.5 < history[-1]["draft/acc_pos_0"]
    return policy, draft.eval()


PROMPTS = [[3, 4, 5, 6, 3, 4, 5], [7, 8, 9], [10, 11, 12, 13, 14, 15, 10, 11, 12, 13], [20]]


def test_greedy_speculative_equals_greedy_plain_on_ragged_prompts(trained):
    policy, draft = trained
    kw = dict(temperature=0, max_new_tokens=24, stop_token_ids=[1, 2])
    plain = generate(policy, PROMPTS, **kw)
    spec = generate(policy, PROMPTS, drafter=draft.drafter(), num_speculative_tokens=3, **kw)
    assert spec.tokens == plain.tokens
    assert spec.finish_reasons == plain.finish_reasons
    assert spec.stats.draft_tokens_accepted > 0, "the trained draft should get some drafts accepted"


@pytest.mark.parametrize("params", [SamplingParams(1.0), SamplingParams(0.9, top_p=0.8)], ids=["t1", "top_p"])
def test_eagle3_speculative_samples_follow_the_target_distribution(params):
    """The lossless chi-square check of tests/rollout with the untrained EAGLE-3 draft, whose
    6-token draft vocab gives zero probability to two of the target's 8 tokens."""
    model = tiny_model(vocab_size=8, sharpen=2.0, tie_word_embeddings=False)
    draft = make_draft(model, tap_layers=[0, 1], draft_vocab_size=6).float()
    with torch.no_grad():
        draft.lm_head.weight.mul_(4.0)  # a confident draft: far from the target
    torch.manual_seed(5)  # draft tokens are drawn from torch's global generator
    counts = sampled_counts(model, draft.drafter(), params, 16000, seed=7)
    assert chi_square_pvalue(counts, exact_joint(model, params)) > ALPHA


@pytest.mark.skipif(not (packing_available() and int8_packing_available()), reason="no packing or quantized engine")
def test_an_int8_draft_samples_the_target_distribution_and_keeps_its_tap_fusion_in_a_float_dtype():
    """draft.inference_dtype=int8 (auto where the engine is there): the draft draws from what its int8 matmuls
    compute and reports that distribution, so verification keeps the target's; its fusion reads raw taps and
    stays float."""
    model = tiny_model(vocab_size=8, sharpen=2.0, tie_word_embeddings=False)
    draft = make_draft(model, tap_layers=[0, 1], draft_vocab_size=6, inference_dtype="int8").float()
    with torch.no_grad():
        draft.lm_head.weight.mul_(4.0)
    torch.manual_seed(5)
    params = SamplingParams(1.0)
    counts = sampled_counts(model, draft.drafter(), params, 16000, seed=7)
    assert chi_square_pvalue(counts, exact_joint(model, params)) > ALPHA
    assert draft.lm_head.packed.dtype == draft.midlayer.mlp.gate_up.packed.dtype == torch.int8
    assert draft.fusion.fc.packed.dtype in (torch.bfloat16, torch.float32)


# --- export ---


def test_export_then_load_gives_the_same_draft(tmp_path):
    policy = policy_model()
    draft = make_draft(policy)
    path = export_draft(draft, tmp_path / "eagle3")
    export_draft(draft, path)  # replacing an existing export works
    config = json.loads((path / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    assert config["draft_vocab_size"] == 32 and config["vocab_size"] == V and config["tie_word_embeddings"] is False
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 3, 5]  # SGLang: layer outputs
    assert config["eagle_aux_hidden_state_layer_ids"] == [2, 4, 6]  # vLLM: layer inputs
    for key in (
        "hidden_size",
        "intermediate_size",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "rms_norm_eps",
        "rope_theta",
        "rope_scaling",
        "max_position_embeddings",
    ):
        assert key in config
    from safetensors.torch import load_file

    names = set(load_file(path / "model.safetensors"))
    assert names == {
        "fc.weight",
        "norm.weight",
        "lm_head.weight",
        "d2t",
        "t2d",
        *(f"midlayer.{n}.weight" for n in ("input_layernorm", "hidden_norm", "post_attention_layernorm")),
        *(f"midlayer.self_attn.{n}_proj.weight" for n in "qkvo"),
        *(f"midlayer.mlp.{n}_proj.weight" for n in ("gate", "up", "down")),
    }

    loaded = load_draft(path, policy)
    assert isinstance(loaded, Eagle3Draft) and loaded.tap_layers == draft.tap_layers
    batch = packed_batch(policy, draft)
    torch.testing.assert_close(loaded.loss(batch)[0], draft.loss(batch)[0], rtol=0, atol=0)
    proposals = []
    for d in (draft, loaded):
        torch.manual_seed(3)
        proposals.append(generate(policy, PROMPTS, drafter=d.drafter(), max_new_tokens=8, seed=1).tokens)
    assert proposals[0] == proposals[1]

    # a directory written by another tool: no codraft keys, taps only in vLLM's top-level key
    for key in ("codraft_family", "codraft_config", "eagle_config"):
        config.pop(key)
    (path / "config.json").write_text(json.dumps(config))
    assert load_draft(path, policy).tap_layers == draft.tap_layers


def test_load_names_the_field_that_does_not_fit(tmp_path):
    policy = policy_model()
    path = export_draft(make_draft(policy), tmp_path / "eagle3")
    with pytest.raises(ValueError, match="hidden_size"):
        load_draft(path, policy_model(hidden_size=64))
    with pytest.raises(ValueError, match="eagle_aux_hidden_state_layer_ids"):
        load_draft(path, policy_model(num_layers=2))
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(config | {"draft_vocab_size": 16}))
    with pytest.raises(ValueError, match="draft weight d2t"):
        load_draft(path, policy)
    (path / "config.json").write_text(json.dumps(config | {"codraft_family": "medusa"}))
    with pytest.raises(ValueError, match="codraft_family"):
        load_draft(path, policy)


def test_a_draft_built_with_head_from_policy_decodes_hidden_states_as_the_policy_does():
    from codraft.drafts import build_draft
    from tests.drafts.blocks import draft_config, tiny_policy

    policy = tiny_policy(dtype=torch.float32)
    corpus = [[i % 37 for i in range(n, n + 20)] for n in range(5)]
    draft = build_draft(draft_config("eagle3", draft_vocab_size=16, head_from_policy=True), policy, None, corpus)
    hidden = torch.randn(3, policy.args.hidden_size)
    torch.testing.assert_close(draft.head(hidden), policy.logits(hidden)[:, draft.draft_ids()])
    random = build_draft(draft_config("eagle3", draft_vocab_size=16), policy, None, corpus)
    assert not torch.allclose(random.head(hidden), policy.logits(hidden)[:, random.draft_ids()])


def test_a_draft_built_with_layer_from_policy_starts_as_the_policys_next_layer():
    """Taps 0, 1, L-2, the layer from L-1 and the head from the policy: TTT step 0 gives the policy's own logits
    at every position, since fc passes layer L-2's output to a copy of layer L-1 and the embedding's half is 0."""
    from codraft.drafts import build_draft
    from tests.drafts.blocks import draft_config, tiny_policy

    policy = tiny_policy(dtype=torch.float64, num_layers=4)
    cfg = draft_config("eagle3", draft_vocab_size=0, tap_layers=[0, 1, 2], layer_from_policy=3, head_from_policy=True)
    draft = build_draft(cfg, policy, None, [])
    ids = torch.randint(0, policy.args.vocab_size, (1, 11), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        out = policy(ids, taps=draft.tap_layers)
        feats = draft.fuse({layer: t[0] for layer, t in out.taps.items()})
        logits = draft.ttt_forward(feats, ids[0], torch.tensor([0, 11]), torch.arange(11), steps=1)[0]
    torch.testing.assert_close(logits, out.logits[0])
    # the embedding's half is zero but trainable: the loss reaches it
    embed_half = draft.midlayer.self_attn.q_proj.weight[:, : policy.args.hidden_size]
    assert not embed_half.any() and embed_half.requires_grad


def test_layer_from_policy_names_what_would_be_valid():
    from codraft.config import ConfigError
    from codraft.drafts import build_draft
    from tests.drafts.blocks import draft_config, tiny_policy

    policy = tiny_policy(num_layers=4)
    with pytest.raises(ConfigError, match=r"draft.layer_from_policy.*\[0, 3\]"):
        build_draft(draft_config("eagle3", layer_from_policy=4), policy)
    with pytest.raises(ConfigError, match="draft.layer_from_policy.*DFlash"):
        draft_config("dflash", layer_from_policy=1).validate()
    qwen = Transformer(ModelArgs(**(vars(policy.args) | {"qk_norm": True})))
    with pytest.raises(ValueError, match="q/k norms"):
        build_draft(draft_config("eagle3", layer_from_policy=3), qwen)


def test_a_stopped_proposal_is_the_first_drafts_of_the_whole_one(trained):
    """`stop` is asked after each draft but the last, with the confidences so far; where it says stop, the proposal
    is the first drafts of the one it would have made (the next draft forward is not run)."""
    policy, draft = trained
    prompts = PROMPTS[:3]
    ids = torch.zeros(len(prompts), max(map(len, prompts)), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, : len(p)] = torch.tensor(p)
    with torch.no_grad():
        taps = policy(ids, taps=draft.tap_layers).taps
    pending, params = torch.tensor([5, 6, 7]), SamplingParams(0.0)
    proposals, asked = [], []
    for stop in (None, lambda c: asked.append(c.shape) or c.shape[1] == 2):
        drafter = draft.drafter()
        drafter.start(prompts, taps, params, 64)
        proposals.append(drafter.propose(pending, 4, stop=stop))
    whole, stopped = proposals
    assert asked == [(3, 1), (3, 2)]
    assert stopped.lengths.tolist() == [2, 2, 2] and stopped.tokens.shape == (3, 2)
    assert torch.equal(stopped.tokens, whole.tokens[:, :2])
    torch.testing.assert_close(stopped.confidence, whole.confidence[:, :2])


def test_greedy_speculation_that_stops_drafts_early_equals_plain_decoding(trained):
    """A controller whose rule ends some proposals after one or two drafts of k = 3: tokens as plain decoding's,
    steps counted at k = 3 with fewer drafts made; a sampled call is given no rule."""
    from codraft.rollout import SpeculationController
    from codraft.rollout.calibration import DraftStop

    class Stopping(SpeculationController):
        def __init__(self):
            super().__init__(3)
            self.rules = 0

        def choose(self, rows, remaining=None):
            self.probing = False
            return 3

        def stop_rule(self, rows, k):
            self.rules += 1
            return DraftStop(self.calibration, min_accepted=0.0 if self.rules % 3 == 0 else 10.0 * (self.rules % 2))

    policy, draft = trained
    kw = dict(temperature=0, max_new_tokens=24, stop_token_ids=[])
    plain = generate(policy, PROMPTS, **kw)
    c = Stopping()
    spec = generate(policy, PROMPTS, drafter=draft.drafter(), num_speculative_tokens=3, adaptive=c, **kw)
    assert spec.tokens == plain.tokens
    assert set(spec.stats.k_chosen) == {3} and 1 <= spec.stats.drafts_per_step < 3
    assert spec.stats.draft_tokens_accepted > 0
    sampled = Stopping()
    generate(policy, PROMPTS, drafter=draft.drafter(), num_speculative_tokens=3, adaptive=sampled, seed=0,
             **(kw | {"temperature": 1.0}))
    assert sampled.rules == 0
