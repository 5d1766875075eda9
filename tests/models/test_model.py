"""The decoder's modes agree with each other: cache decode, verify+rollback, packed, stages."""

import pytest
import torch

from codraft.models import ModelArgs, Transformer


def tiny(**overrides) -> Transformer:
    torch.manual_seed(0)
    args = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_layers=4, num_heads=4, num_kv_heads=2)
    args.update(overrides)
    return Transformer(ModelArgs(**args)).double().eval()


def full_logits(model: Transformer, ids: list[int]) -> torch.Tensor:
    return model(torch.tensor([ids])).logits[0]


@torch.no_grad()
def test_cache_decode_token_by_token_matches_full_forward_ragged():
    model = tiny(qk_norm=True, attention_bias=True)
    seqs = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14], [1, 2, 3, 40, 41, 42, 43, 44, 45, 46, 47]]
    prompt_lens = torch.tensor([3, 6])
    cache = model.new_cache(batch_size=2, max_len=32)
    prompts = torch.tensor([s[:6] for s in seqs])  # row 0 is right-padded with its own later tokens
    out = model(prompts, cache=cache)
    cache.lengths.copy_(prompt_lens)
    for b, s in enumerate(seqs):
        torch.testing.assert_close(out.logits[b, prompt_lens[b] - 1], full_logits(model, s)[prompt_lens[b] - 1])
    for _ in range(4):
        nxt = torch.tensor([[seqs[b][int(cache.lengths[b])]] for b in range(2)])
        step = model(nxt, cache=cache)
        for b, s in enumerate(seqs):
            torch.testing.assert_close(step.logits[b, 0], full_logits(model, s)[int(cache.lengths[b])])
        cache.advance(1)


@torch.no_grad()
def test_verify_chunks_with_rollback_match_full_forward():
    model = tiny()
    seqs = [list(range(10, 30)), list(range(40, 61))]
    cache = model.new_cache(batch_size=2, max_len=40)
    model(torch.tensor([s[:4] for s in seqs]), cache=cache)
    cache.lengths.fill_(4)
    gen = torch.Generator().manual_seed(1)
    for _ in range(4):
        lens = cache.lengths.clone()
        chunk = []
        for b, s in enumerate(seqs):  # true next token, then 3 tokens that are wrong from a random point on
            true = s[int(lens[b]) : int(lens[b]) + 4]
            cut = int(torch.randint(1, 4, (1,), generator=gen))
            chunk.append(true[:cut] + [0] * (4 - cut))
        chunk = torch.tensor(chunk)
        out = model(chunk, cache=cache, taps=[1])
        accepted = []
        for b, s in enumerate(seqs):
            ref = full_logits(model, s)
            n_ok = int((chunk[b] == torch.tensor(s[int(lens[b]) : int(lens[b]) + 4])).cumprod(0).sum())
            torch.testing.assert_close(out.logits[b, :n_ok], ref[int(lens[b]) : int(lens[b]) + n_ok])
            accepted.append(n_ok)
        cache.advance(torch.tensor(accepted) + 1)  # keep the accepted tokens plus one wrong one ...
        cache.rollback(cache.lengths - 1)  # ... then roll it back again


@torch.no_grad()
def test_packed_forward_equals_separate_forwards():
    model = tiny(qk_norm=True)
    seqs = [list(range(3, 10)), list(range(20, 23)), list(range(50, 62))]
    packed = torch.tensor([sum(seqs, [])])
    cu = torch.tensor([0, 7, 10, 22])
    out = model(packed, cu_seqlens=cu, taps=[2])
    for s, (a, b) in zip(seqs, [(0, 7), (7, 10), (10, 22)], strict=True):
        alone = model(torch.tensor([s]), taps=[2])
        torch.testing.assert_close(out.logits[0, a:b], alone.logits[0])
        torch.testing.assert_close(out.taps[2][0, a:b], alone.taps[2][0])


def test_stages_compose_to_the_full_model():
    model = tiny(tie_word_embeddings=False)
    stages = [
        Transformer(model.args, layers=(0, 1)),
        Transformer(model.args, layers=(1, 3)),
        Transformer(model.args, layers=(3, 4)),
    ]
    full_state = model.state_dict()
    for stage in stages:
        stage.double().load_state_dict({k: full_state[k] for k in stage.state_dict()})
    ids = torch.randint(0, 97, (2, 9))
    ref = model(ids, taps=[0, 2, 3])
    x, taps = ids, {}
    for stage in stages:
        out = stage(x, taps=[0, 2, 3])
        x, taps = out.hidden, taps | out.taps
    torch.testing.assert_close(out.logits, ref.logits)
    assert sorted(taps) == [0, 2, 3]
    for i in taps:
        torch.testing.assert_close(taps[i], ref.taps[i])
    assert stages[0].lm_head is None and stages[1].embed_tokens is None and stages[2].embed_tokens is None


def test_taps_match_transformers_hidden_states():
    import transformers

    cfg = transformers.LlamaConfig(
        vocab_size=97,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(cfg).eval()
    model = Transformer(
        ModelArgs(
            vocab_size=97,
            hidden_size=64,
            intermediate_size=96,
            num_layers=4,
            num_heads=4,
            num_kv_heads=2,
            rms_norm_eps=cfg.rms_norm_eps,
        )
    )
    model.load_state_dict({k.removeprefix("model."): v for k, v in hf.state_dict().items()})
    ids = torch.randint(0, 97, (2, 11))
    with torch.no_grad():
        ref = hf(ids, output_hidden_states=True)
        out = model(ids, taps=range(4))
    torch.testing.assert_close(out.logits, ref.logits, atol=1e-5, rtol=1e-5)
    for layer in range(3):  # HF's last hidden state is after the final norm; taps are pre-norm
        torch.testing.assert_close(out.taps[layer], ref.hidden_states[layer + 1], atol=1e-5, rtol=1e-5)


def test_logits_at_rows_are_the_full_head_s_there_and_zero_elsewhere():
    model = tiny()
    ids = torch.randint(0, 97, (1, 10))
    cu = torch.tensor([0, 4, 10])
    rows = torch.tensor([2, 3, 7, 8])
    full = model(ids, cu_seqlens=cu).logits
    part = model(ids, cu_seqlens=cu, logit_rows=rows).logits
    assert part.shape == full.shape
    torch.testing.assert_close(part[0, rows], full[0, rows])
    others = torch.ones(10, dtype=torch.bool).index_fill(0, rows, False)
    assert torch.equal(part[0, others], torch.zeros_like(part[0, others]))


@torch.no_grad()
def test_the_head_runs_at_the_weights_precision_under_a_training_autocast():
    """rl.policy_matmul_dtype autocasts the layers' matmuls; the head's logits (RL's log-probs) stay fp32, bit for
    bit what the head gives the same hidden states without autocast."""
    model = tiny().float()
    ids = torch.randint(0, 97, (1, 10))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(ids)
    assert out.logits.dtype == torch.float32
    assert torch.equal(out.logits, model.logits(out.hidden))
    assert not torch.equal(out.logits, model(ids).logits)  # the layers did run in bf16


@torch.no_grad()
def test_a_cached_forward_of_active_tokens_equals_the_full_one_on_them():
    """Rows feeding a prefix of their tokens (3, 1 and 4 of 4): logits, hidden, taps and cache keys of those
    tokens are the full forward's, and the others are zero."""
    model = tiny(qk_norm=True, attention_bias=True)
    ids = torch.randint(0, 97, (3, 4), generator=torch.Generator().manual_seed(3))
    fed = torch.arange(4)[None] < torch.tensor([3, 1, 4])[:, None]
    runs = []
    for active in (None, fed.flatten().nonzero().squeeze(1)):
        cache = model.new_cache(batch_size=3, max_len=16)
        model(torch.tensor([[5, 6, 7, 8, 9]] * 3), cache=cache)
        cache.lengths.fill_(5)
        runs.append((model(ids, cache=cache, taps=[1], active=active), cache))
    (full, full_cache), (part, part_cache) = runs
    for name in ("logits", "hidden"):
        torch.testing.assert_close(getattr(part, name)[fed], getattr(full, name)[fed])
        assert not getattr(part, name)[~fed].any()
    torch.testing.assert_close(part.taps[1][fed], full.taps[1][fed])
    for b, n in enumerate([3, 1, 4]):
        torch.testing.assert_close(part_cache.k[:, b, :, : 5 + n], full_cache.k[:, b, :, : 5 + n])


def test_rms_norm_in_one_op_is_bit_for_bit_the_step_by_step_norm():
    from codraft.models.model import RMSNorm

    norm = RMSNorm(64, 1e-6)
    norm.weight.data = torch.randn(64)
    for shape in [(1, 1, 64), (8, 5, 64), (300, 64)]:
        x = torch.randn(*shape)
        reference = norm.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))
        assert torch.equal(norm(x), reference)


def test_rotary_is_bit_for_bit_hf_rotate_half():
    from codraft.models.rope import RotaryEmbedding, apply_rotary, rope_frequencies

    args = ModelArgs(vocab_size=97, hidden_size=64, intermediate_size=96, num_layers=1, num_heads=4, num_kv_heads=2)
    positions = torch.tensor([[0, 3, 17], [5, 6, 99]])
    x = torch.randn(2, 3, 4, args.head_dim)  # [B, S, H, D]
    inv_freq, _ = rope_frequencies(args)
    emb = torch.cat([positions[..., None].float() * inv_freq] * 2, -1)[..., None, :]  # HF's cos/sin tables
    x1, x2 = x.chunk(2, -1)
    expected = x * emb.cos() + torch.cat((-x2, x1), -1) * emb.sin()
    assert torch.equal(apply_rotary(x, *RotaryEmbedding(args)(positions, x.dtype)), expected)


def test_finished_rows_slots_are_refilled_from_the_end_in_place():
    from codraft.models.kv_cache import take_rows
    from codraft.rollout.engine import compaction

    done = torch.tensor([False, True, False, False, True, False])
    keep = compaction(done)
    assert keep.tolist() == [0, 5, 2, 3]  # row 1's slot takes row 5; rows 0, 2, 3 stay where they are
    t = torch.arange(18.0).view(6, 3)
    expected, storage = t[keep], t.data_ptr()
    kept = take_rows(t, keep, 0)
    assert torch.equal(kept, expected) and kept.data_ptr() == storage
    more = torch.tensor([1, 1, 0, 3, 2])  # more rows than there are (a prompt's copies): a new tensor
    assert torch.equal(take_rows(kept, more, 0), expected[more])
    assert compaction(torch.tensor([True, True])).numel() == 0


@torch.no_grad()
def test_on_codraft_s_kernels_a_verify_forward_gives_a_decode_step_s_bits_with_bf16_activations():
    """Greedy speculation is lossless only if a verify forward computes what decode steps compute, bit for bit: with
    bf16 activations (bf16 pairs on the kernel) an fp32 difference of 1e-7 anywhere (attention's sums over another
    number of queries or keys) flips a rounding into a whole bf16 step. Three rows of different lengths: 5 tokens fed
    at once give the logits and cache keys of the same 5 fed one at a time."""
    from codraft.models import cpu_kernels
    from codraft.models.linear import pack_linears, packed_kernels

    if cpu_kernels.cpu_kernels() is None:
        pytest.skip("codraft's kernels do not run here (no AVX-512, OpenMP or C++ compiler)")
    # head_dim 64, SmolLM2's: with the grouped matmuls' attention these logits were up to 0.02 apart (checked)
    model = tiny(num_layers=6, hidden_size=256, intermediate_size=384).float()
    pack_linears(model, dtype=torch.bfloat16)
    kind = "codraft_bf16" if cpu_kernels.bf16_dot_products() else "codraft_bf16_weights"
    assert kind in packed_kernels(model)
    g = torch.Generator().manual_seed(0)
    prompts, lengths = torch.randint(0, 97, (3, 40), generator=g), torch.tensor([40, 23, 31])
    new = torch.randint(0, 97, (3, 5), generator=g)
    runs = []
    for fed in (5, 1):
        cache = model.new_cache(batch_size=3, max_len=64)
        model(prompts, cache=cache)
        cache.lengths.copy_(lengths)
        logits = []
        for i in range(0, 5, fed):
            logits.append(model(new[:, i : i + fed], cache=cache).logits)
            cache.advance(fed)
        runs.append((torch.cat(logits, 1), cache.k[:, 0, :, :45].clone()))
    (verify, verify_keys), (decode, decode_keys) = runs
    assert torch.equal(verify, decode) and torch.equal(verify_keys, decode_keys)
