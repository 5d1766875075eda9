"""The policy model: decoder, KV cache, loaders."""

from codraft.models.args import ModelArgs
from codraft.models.kv_cache import KVCache
from codraft.models.loading import load_model, load_policy, policy_args
from codraft.models.model import ModelOutput, Transformer
from codraft.models.presets import PRESETS
from codraft.models.tokenizer import Tokenizer

__all__ = ["PRESETS", "KVCache", "ModelArgs", "ModelOutput", "Tokenizer", "Transformer", "load_model", "load_policy",
           "policy_args"]
