"""The policy model: decoder, KV cache, loaders."""

from codraft.models.args import ModelArgs
from codraft.models.kv_cache import KVCache
from codraft.models.model import ModelOutput, Transformer

__all__ = ["KVCache", "ModelArgs", "ModelOutput", "Transformer"]
