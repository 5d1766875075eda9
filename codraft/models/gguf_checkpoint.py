"""Read a llama.cpp GGUF file: metadata -> ModelArgs, tensors -> dequantized codraft state dict.

Two things differ from a Hugging Face checkpoint besides the names:
- ggml lists dimensions fastest-first, so a torch [out, in] weight is ggml [in, out]
  (we reshape every dequantized tensor to the header's dims reversed);
- llama.cpp's converter permutes the rows of q_proj/k_proj of `llama` models (it
  turns HF's half-split rotary layout into GPT-J's interleaved one); we undo it.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

import gguf
import torch

from codraft.models.args import ModelArgs

logger = logging.getLogger(__name__)

ARCHITECTURES = ("llama", "qwen2", "qwen3")
# architectures whose q/k rows llama.cpp permutes for rope (Qwen's converter does not)
PERMUTED_QK = ("llama",)

_GLOBAL_NAMES = {
    "token_embd": "embed_tokens",
    "output_norm": "norm",
    "output": "lm_head",
}
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_BLOCK_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def gguf_metadata(reader: gguf.GGUFReader) -> dict[str, Any]:
    """All key/value fields of the file as plain Python values."""
    return {name: field.contents() for name, field in reader.fields.items() if not name.startswith("GGUF.")}


def codraft_name(gguf_name: str) -> str:
    """`blk.3.attn_q.weight` -> `layers.3.self_attn.q_proj.weight`."""
    if match := _BLOCK_RE.fullmatch(gguf_name):
        layer, part, kind = match.groups()
        if part in _BLOCK_NAMES:
            return f"layers.{layer}.{_BLOCK_NAMES[part]}.{kind}"
    else:
        base, _, kind = gguf_name.rpartition(".")
        if base in _GLOBAL_NAMES:
            return f"{_GLOBAL_NAMES[base]}.{kind}"
    raise ValueError(f"GGUF tensor {gguf_name!r} has no codraft equivalent (rope_freqs, MoE, ... are not supported)")


def model_args_from_gguf(meta: dict[str, Any], tensor_shapes: dict[str, tuple[int, ...]]) -> ModelArgs:
    """Map GGUF metadata (llama.cpp key names) to ModelArgs; tensor shapes are in torch order."""
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise ValueError(f"GGUF general.architecture={arch!r} is not supported; valid: {', '.join(ARCHITECTURES)}")

    def key(name: str, default: Any = None) -> Any:
        value = meta.get(f"{arch}.{name}", default)
        if value is None:
            raise ValueError(f"GGUF file lacks the required field {arch}.{name}")
        return value

    if "rope_freqs.weight" in tensor_shapes:
        raise ValueError("GGUF tensor rope_freqs.weight (llama3 rope frequency factors) is not supported")
    scaling_type = key("rope.scaling.type", "none")
    if scaling_type not in ("none", "linear"):
        raise ValueError(f"GGUF {arch}.rope.scaling.type={scaling_type!r} is not supported; valid: none, linear")
    rope_scaling = {"rope_type": "linear", "factor": key("rope.scaling.factor")} if scaling_type == "linear" else None

    hidden, heads = key("embedding_length"), key("attention.head_count")
    head_dim = key("attention.key_length", hidden // heads)
    rope_dim = key("rope.dimension_count", head_dim)
    if rope_dim != head_dim:
        raise ValueError(
            f"GGUF {arch}.rope.dimension_count={rope_dim} (partial rotary) is not supported; "
            f"valid: {head_dim} (the head dim)"
        )
    eos = meta.get("tokenizer.ggml.eos_token_id")
    return ModelArgs(
        vocab_size=tensor_shapes["token_embd.weight"][0],
        hidden_size=hidden,
        intermediate_size=key("feed_forward_length"),
        num_layers=key("block_count"),
        num_heads=heads,
        num_kv_heads=key("attention.head_count_kv", heads),
        head_dim=head_dim,
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon")),
        rope_theta=float(key("rope.freq_base", 10000.0)),
        rope_scaling=rope_scaling,
        max_position_embeddings=key("context_length"),
        # llama.cpp writes `output.weight` only when the head is not the embedding
        tie_word_embeddings="output.weight" not in tensor_shapes,
        attention_bias="blk.0.attn_q.bias" in tensor_shapes,
        qk_norm="blk.0.attn_q_norm.weight" in tensor_shapes,
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_id=[] if eos is None else [eos],
        pad_token_id=meta.get("tokenizer.ggml.padding_token_id"),
    )


def unpermute_rope_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Invert llama.cpp's `permute`: per head, rows (pair, half) -> (half, pair). weight [H*D, ...]."""
    half = weight.shape[0] // num_heads // 2
    return weight.reshape(num_heads, half, 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)


def tensor_shapes(reader: gguf.GGUFReader) -> dict[str, tuple[int, ...]]:
    """GGUF tensor name -> shape in torch order (ggml's dims reversed)."""
    return {t.name: tuple(int(d) for d in reversed(t.shape.tolist())) for t in reader.tensors}


def _dequantized(reader: gguf.GGUFReader, arch: str, args: ModelArgs) -> dict[str, torch.Tensor]:
    """Every tensor dequantized to fp32, renamed to codraft keys, q/k rows restored where permuted."""
    shapes = tensor_shapes(reader)
    state: dict[str, torch.Tensor] = {}
    for tensor in reader.tensors:
        # torch.tensor copies: unquantized tensors come back as read-only views of the memory-mapped file
        weight = torch.tensor(gguf.quants.dequantize(tensor.data, tensor.tensor_type)).reshape(shapes[tensor.name])
        name = codraft_name(tensor.name)
        if arch in PERMUTED_QK and ".q_proj." in name:
            weight = unpermute_rope_rows(weight, args.num_heads)
        elif arch in PERMUTED_QK and ".k_proj." in name:
            weight = unpermute_rope_rows(weight, args.num_kv_heads)
        state[name] = weight
    return state


def read_gguf(path: Path) -> tuple[ModelArgs, dict[str, torch.Tensor], dict[str, Any]]:
    """(ModelArgs, fp32 state dict with codraft names, metadata for the tokenizer) of a GGUF file."""
    logger.info("reading and dequantizing GGUF %s", path)
    reader = gguf.GGUFReader(path)
    meta = gguf_metadata(reader)
    args = model_args_from_gguf(meta, tensor_shapes(reader))
    return args, _dequantized(reader, meta["general.architecture"], args), meta
