"""Read a Hugging Face checkpoint directory: `config.json` -> ModelArgs, safetensors -> state dict.

Only safetensors are read. Pickled weights (`.bin`, `.pt`) can run arbitrary code when
loaded, so a directory holding only those is refused rather than unpickled.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from safetensors import safe_open

from codraft.models.args import ModelArgs

logger = logging.getLogger(__name__)

# architecture -> (attention_bias, qk_norm) implied by the family
ARCHITECTURES = {
    "LlamaForCausalLM": (False, False),
    "MistralForCausalLM": (False, False),
    "Qwen2ForCausalLM": (True, False),
    "Qwen3ForCausalLM": (False, True),
}
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


def read_json(path: Path) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except ValueError as e:  # not UTF-8, not JSON
        raise ValueError(f"{path} is not valid JSON ({e})") from e


def _eos_ids(value: int | list[int] | None) -> list[int]:
    if value is None:
        return []
    return [value] if isinstance(value, int) else list(value)


def _rope(config: dict) -> tuple[float, dict | None]:
    """rope_theta and rope_scaling from either transformers-5 `rope_parameters` or the older pair."""
    params = config.get("rope_parameters")
    if params is None:
        return float(config.get("rope_theta", 10000.0)), config.get("rope_scaling")
    scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    if scaling.get("rope_type", scaling.get("type", "default")) == "default":
        scaling = None
    return float(params.get("rope_theta", config.get("rope_theta", 10000.0))), scaling


def _check_supported(config: dict, arch: str) -> None:
    """Refuse options the decoder does not implement, naming the config field."""
    if config.get("hidden_act", "silu") != "silu":
        raise ValueError(f"config.json hidden_act={config['hidden_act']!r} is not supported; valid: 'silu'")
    if config.get("mlp_bias"):
        raise ValueError("config.json mlp_bias=true is not supported; valid: false")
    if arch != "Qwen2ForCausalLM" and config.get("attention_bias"):
        # Llama/Mistral/Qwen3 put the bias on o_proj too, which the decoder does not have
        raise ValueError(f"config.json attention_bias=true is not supported for {arch}; valid: false")
    sliding = config.get("use_sliding_window", arch == "MistralForCausalLM") and config.get("sliding_window")
    if sliding:
        raise ValueError(
            f"config.json sliding_window={config['sliding_window']} is not supported; "
            "valid: null, or use_sliding_window=false"
        )
    layer_types = set(config.get("layer_types") or ["full_attention"])
    if layer_types != {"full_attention"}:
        raise ValueError(f"config.json layer_types={sorted(layer_types)} is not supported; valid: ['full_attention']")


def model_args_from_config(config: dict, generation_config: dict | None = None) -> ModelArgs:
    """Map a Hugging Face `config.json` dict (plus optional `generation_config.json`) to ModelArgs."""
    archs = config.get("architectures") or []
    arch = next((a for a in archs if a in ARCHITECTURES), None)
    if arch is None:
        raise ValueError(f"config.json architectures={archs} is not supported; valid: {', '.join(ARCHITECTURES)}")
    _check_supported(config, arch)
    attention_bias, qk_norm = ARCHITECTURES[arch]
    rope_theta, rope_scaling = _rope(config)
    eos = _eos_ids(config.get("eos_token_id"))
    # chat models often list their end-of-turn token only in generation_config.json
    eos += [i for i in _eos_ids((generation_config or {}).get("eos_token_id")) if i not in eos]
    return ModelArgs(
        vocab_size=config["vocab_size"],
        hidden_size=config["hidden_size"],
        intermediate_size=config["intermediate_size"],
        num_layers=config["num_hidden_layers"],
        num_heads=config["num_attention_heads"],
        num_kv_heads=config.get("num_key_value_heads") or config["num_attention_heads"],
        head_dim=config.get("head_dim"),
        rms_norm_eps=config.get("rms_norm_eps", 1e-6),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        max_position_embeddings=config.get("max_position_embeddings", 8192),
        tie_word_embeddings=config.get("tie_word_embeddings", False),
        attention_bias=attention_bias,
        qk_norm=qk_norm,
        bos_token_id=config.get("bos_token_id"),
        eos_token_id=eos,
        pad_token_id=config.get("pad_token_id"),
    )


def read_hf_args(path: Path) -> ModelArgs:
    config_path = path / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"{path} has no config.json; a Hugging Face checkpoint directory needs one")
    generation_path = path / "generation_config.json"
    generation = read_json(generation_path) if generation_path.is_file() else None
    try:
        return model_args_from_config(read_json(config_path), generation)
    except KeyError as e:
        raise ValueError(f"{config_path} has no field {e}, which a decoder config needs") from e


def _weight_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        return [path / name for name in sorted(set(read_json(index)["weight_map"].values()))]
    if (path / "model.safetensors").is_file():
        return [path / "model.safetensors"]
    shards = sorted(path.glob("*.safetensors"))
    if shards:
        return shards
    if any(p.suffix in PICKLE_SUFFIXES for p in path.iterdir()):
        raise ValueError(
            f"{path} holds only pickled weights ({', '.join(PICKLE_SUFFIXES)}); pickled checkpoints are refused "
            "for safety (unpickling can run arbitrary code). Convert them to safetensors first."
        )
    raise FileNotFoundError(f"{path} has no model.safetensors or model.safetensors.index.json")


def codraft_key(hf_key: str) -> str | None:
    """HF parameter name -> codraft name (no `model.` prefix); None for keys the decoder does not hold."""
    if hf_key.endswith("rotary_emb.inv_freq"):  # older checkpoints saved the rope buffer
        return None
    return hf_key.removeprefix("model.")


def read_hf_state_dict(path: Path) -> dict[str, torch.Tensor]:
    """All weights of the checkpoint, with codraft names, in their stored dtype, on CPU."""
    state: dict[str, torch.Tensor] = {}
    for file in _weight_files(path):
        with safe_open(file, framework="pt", device="cpu") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                name = codraft_key(key)
                if name is not None:
                    state[name] = f.get_tensor(key)
    logger.debug("read %d tensors from %s", len(state), path)
    return state
