"""ModelArgs: every shape and option of the policy decoder in one place."""

from __future__ import annotations

from dataclasses import dataclass, field

ROPE_TYPES = ("default", "linear", "llama3", "yarn")


@dataclass
class ModelArgs:
    """Llama / Qwen2 / Qwen3 family decoder.

    Qwen2 = Llama + ``attention_bias`` on q/k/v; Qwen3 = Llama + ``qk_norm``.
    ``rope_scaling`` follows the Hugging Face ``config.json`` dict
    (``{"rope_type": "llama3", "factor": 8.0, ...}``) or is None.
    """

    vocab_size: int = 32000
    hidden_size: int = 576
    intermediate_size: int = 1536
    num_layers: int = 30
    num_heads: int = 9
    num_kv_heads: int = 3
    head_dim: int | None = None  # defaults to hidden_size // num_heads
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 8192
    tie_word_embeddings: bool = True
    attention_bias: bool = False  # Qwen2
    qk_norm: bool = False  # Qwen3
    bos_token_id: int | None = None
    eos_token_id: list[int] = field(default_factory=list)
    pad_token_id: int | None = None

    def __post_init__(self) -> None:
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_heads
        if isinstance(self.eos_token_id, int):
            self.eos_token_id = [self.eos_token_id]
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        rope_type = (self.rope_scaling or {}).get("rope_type", (self.rope_scaling or {}).get("type", "default"))
        if rope_type not in ROPE_TYPES:
            raise ValueError(f"rope_scaling.rope_type={rope_type!r} is not supported; valid: {', '.join(ROPE_TYPES)}")

    @property
    def rope_type(self) -> str:
        scaling = self.rope_scaling or {}
        return scaling.get("rope_type", scaling.get("type", "default"))
