"""Fixtures for loader tests: tiny random Hugging Face checkpoints and GGUF files written like llama.cpp's."""

import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers is imported: nothing may download

import gguf
import numpy as np
import pytest
import torch

from codraft.models.presets import byte_tokenizer

TINY = dict(
    vocab_size=300,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)

# HF name (without `model.` / layer prefix) -> llama.cpp name
_GGUF_GLOBAL = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
_GGUF_BLOCK = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


@pytest.fixture
def cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "cache"
    monkeypatch.setenv("CODRAFT_CACHE", str(path))
    return path


def hf_model(arch: str, seed: int = 0, **config):
    """A transformers model of `arch` ("llama", "qwen2", "qwen3", "mistral") with every weight random."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(arch, **(TINY | config))
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():  # HF's init zeroes biases and sets norms to one, which would hide mapping mistakes
        for name, p in model.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else 0.05 * torch.randn_like(p))
    return model


@pytest.fixture
def make_hf_checkpoint(tmp_path: Path):
    """(arch, **config) -> (checkpoint dir holding the byte tokenizer too, the transformers model)."""

    def make(arch: str, max_shard_size: str | None = None, **config):
        model = hf_model(arch, **config)
        path = tmp_path / f"hf-{arch}"
        path.mkdir()
        model.save_pretrained(path, **({"max_shard_size": max_shard_size} if max_shard_size else {}))
        byte_tokenizer().save(path)
        return path, model

    return make


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute: HF half-split rotary rows -> interleaved pairs."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(model, path: Path, arch: str) -> Path:
    """Write `model` as llama.cpp's converter would (F32 tensors, q/k permuted for llama, byte tokenizer)."""
    cfg = model.config
    writer = gguf.GGUFWriter(path, arch)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_key_length(cfg.head_dim)
    writer.add_value_length(cfg.head_dim)
    writer.add_rope_dimension_count(cfg.head_dim)
    writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_vocab_size(cfg.vocab_size)

    tok = byte_tokenizer()
    vocab = tok.backend.get_vocab(with_added_tokens=True)
    tokens = sorted(vocab, key=vocab.get) + ["Ġt"]  # one merged token, so the merges list is not empty
    tokens += [f"<unused{i}>" for i in range(cfg.vocab_size - len(tokens))]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t.startswith("<|") else 1 for t in tokens])
    writer.add_token_merges(["Ġ t"])
    writer.add_eos_token_id(vocab["<|im_end|>"])
    writer.add_chat_template(tok.chat_template)

    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        w = tensor.numpy()
        if name in _GGUF_GLOBAL:
            gguf_name = _GGUF_GLOBAL[name]
        else:
            _, _, layer, rest = name.split(".", 3)
            module, kind = rest.rsplit(".", 1)
            gguf_name = f"blk.{layer}.{_GGUF_BLOCK[module]}.{kind}"
        if arch == "llama" and ".q_proj." in name:
            w = llama_cpp_permute(w, cfg.num_attention_heads)
        elif arch == "llama" and ".k_proj." in name:
            w = llama_cpp_permute(w, cfg.num_key_value_heads)
        writer.add_tensor(gguf_name, np.ascontiguousarray(w, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture
def make_gguf(tmp_path: Path):
    """(arch, **config) -> (path of a .gguf file, the transformers model it was written from)."""

    def make(arch: str, **config):
        model = hf_model(arch, **config)
        return write_gguf(model, tmp_path / f"tiny-{arch}.gguf", arch), model

    return make
