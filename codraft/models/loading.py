"""`load_model`: a preset name, a Hugging Face checkpoint directory or a .gguf file -> (model, tokenizer).

Dequantizing a GGUF takes seconds, so the first load writes the result (safetensors + ModelArgs
JSON + tokenizer files) to a cache directory; later loads of the same file read that instead.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import gguf
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from codraft.config import Config, ConfigError
from codraft.models.args import ModelArgs
from codraft.models.gguf_checkpoint import gguf_metadata, model_args_from_gguf, read_gguf, tensor_shapes
from codraft.models.hf_checkpoint import read_hf_args, read_hf_state_dict
from codraft.models.linear import packed_dtype
from codraft.models.model import Transformer
from codraft.models.presets import PRESETS, byte_tokenizer, random_state_dict
from codraft.models.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

T = TypeVar("T")

CACHE_FORMAT = 1  # bump when what a cache entry holds changes, so old entries are not read


def cache_root() -> Path:
    return Path(os.environ.get("CODRAFT_CACHE") or Path.home() / ".cache" / "codraft")


def gguf_cache_dir(path: Path) -> Path:
    """Cache entry of a GGUF file, keyed by its resolved path, size and mtime."""
    path = path.resolve()
    stat = path.stat()
    key = hashlib.sha256(f"{CACHE_FORMAT}|{path}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    return cache_root() / "gguf" / f"{path.stem}-{key}"


def _write_cache(entry: Path, args: ModelArgs, state: dict[str, torch.Tensor], tokenizer: Tokenizer) -> None:
    """Write into a temporary sibling, then rename: readers see a whole entry or none."""
    entry.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{entry.name}.", dir=entry.parent))
    try:
        save_file(state, tmp / "model.safetensors")
        (tmp / "args.json").write_text(json.dumps(dataclasses.asdict(args), indent=2), encoding="utf-8")
        tokenizer.save(tmp)
        os.replace(tmp, entry)
    except OSError:
        if not entry.is_dir():  # a concurrent load that renamed first is fine; anything else is not
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _read_cache(entry: Path) -> tuple[ModelArgs, dict[str, torch.Tensor], Tokenizer]:
    args = ModelArgs(**json.loads((entry / "args.json").read_text(encoding="utf-8")))
    return args, load_file(entry / "model.safetensors"), Tokenizer.from_hf_dir(entry)


def _load_gguf(path: Path) -> tuple[ModelArgs, dict[str, torch.Tensor], Tokenizer]:
    entry = gguf_cache_dir(path)
    start = time.perf_counter()
    if entry.is_dir():
        checkpoint = _read_cache(entry)
        logger.info("warm load of %s from cache %s in %.2fs", path, entry, time.perf_counter() - start)
        return checkpoint
    args, state, meta = read_gguf(path)
    tokenizer = Tokenizer.from_gguf_metadata(meta)
    _write_cache(entry, args, state, tokenizer)
    logger.info("cold load of %s: dequantized and cached to %s in %.2fs", path, entry, time.perf_counter() - start)
    return args, state, tokenizer


def _merge_eos(args: ModelArgs, tokenizer: Tokenizer) -> None:
    """Stop on every end token either the model config or the tokenizer names."""
    merged = list(dict.fromkeys([*tokenizer.eos_token_ids, *args.eos_token_id]))
    args.eos_token_id = merged
    tokenizer.eos_token_ids = list(merged)


def build_model(
    args: ModelArgs,
    state: dict[str, torch.Tensor],
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
) -> Transformer:
    """A Transformer holding `state` (codraft names) in `dtype` on `device`, without a random init first."""
    with torch.device("meta"):
        model = Transformer(args)
    state = {name: t.to(device=device, dtype=dtype) for name, t in state.items()}
    if args.tie_word_embeddings:
        state.pop("lm_head.weight", None)  # the head IS the embedding; re-tied below
    elif "lm_head.weight" not in state:
        raise ValueError("checkpoint has no lm_head.weight but tie_word_embeddings is false")
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    if args.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
        missing.remove("lm_head.weight")
    if missing or unexpected:
        raise ValueError(f"checkpoint does not match ModelArgs: missing {missing}, unexpected {unexpected}")
    # buffers are not in a checkpoint; the meta construction left them empty
    model.init_buffers(device)
    empty = [name for name, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    assert not empty, f"tensors left on the meta device after loading: {empty}"
    return model


def load_model(
    path_or_preset: str | os.PathLike, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
) -> tuple[Transformer, Tokenizer]:
    """Load a preset (see `PRESETS`), a Hugging Face checkpoint directory or a .gguf file."""
    name = str(path_or_preset)
    preset = PRESETS.get(name)
    if preset is not None and preset.args is not None:
        args = copy.deepcopy(preset.args)  # the model keeps its args; the preset's must stay untouched
        return build_model(args, random_state_dict(args), dtype, device), byte_tokenizer()
    path = preset.locate() if preset is not None else Path(name).expanduser()
    if not path.exists():
        raise FileNotFoundError(
            f"{name!r} is neither an existing path nor a preset; valid presets: {', '.join(PRESETS)}"
        )
    if path.is_dir():
        args, state, tokenizer = read_hf_args(path), read_hf_state_dict(path), Tokenizer.from_hf_dir(path)
    elif path.suffix == ".gguf":
        args, state, tokenizer = _load_gguf(path)
    else:
        raise ValueError(f"{path} is not a Hugging Face checkpoint directory or a .gguf file")
    _merge_eos(args, tokenizer)
    return build_model(args, state, dtype, device), tokenizer


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def read_args(path_or_preset: str | os.PathLike) -> ModelArgs:
    """The ModelArgs `load_model` would build (end tokens not merged with the tokenizer's), without its weights."""
    name = str(path_or_preset)
    preset = PRESETS.get(name)
    if preset is not None and preset.args is not None:
        return copy.deepcopy(preset.args)
    path = preset.locate() if preset is not None else Path(name).expanduser()
    if path.is_dir():
        return read_hf_args(path)
    if path.suffix != ".gguf" or not path.is_file():
        raise FileNotFoundError(f"{name!r} is neither a Hugging Face checkpoint directory, a .gguf file nor a "
                                f"preset ({', '.join(PRESETS)})")
    entry = gguf_cache_dir(path)
    if entry.is_dir():
        return ModelArgs(**json.loads((entry / "args.json").read_text(encoding="utf-8")))
    reader = gguf.GGUFReader(path)  # memory-mapped: the header, not the weights
    return model_args_from_gguf(gguf_metadata(reader), tensor_shapes(reader))


def _read_checked(key: str, read: Callable[[], T]) -> T:
    """A checkpoint that cannot be read is a ConfigError naming its key."""
    try:
        return read()
    except (OSError, ValueError, SafetensorError) as e:  # missing files, refused pickles, bad configs, torn weights
        raise ConfigError(f"{key}: {e}") from e


def check_policy_rules(cfg: Config, args: ModelArgs) -> None:
    """The config rules that need the policy (Config.check_policy), and model.ref_path's architecture."""
    cfg.check_policy(args.num_layers, args.vocab_size)
    if cfg.rl.beta > 0 and cfg.model.ref_path is not None:
        ref = _read_checked("model.ref_path", lambda: read_args(cfg.model.ref_path))
        if dataclasses.replace(ref, eos_token_id=args.eos_token_id) != args:  # end tokens: not the architecture
            raise ConfigError(f"model.ref_path: {cfg.model.ref_path} is not the architecture of model.path "
                              f"{cfg.model.path} (rl.beta > 0 compares their log-probs token by token)")


def policy_args(cfg: Config) -> ModelArgs:
    """model.path's ModelArgs, read without its weights, with every rule of check_policy_rules checked: what a
    launcher checks before it writes the run directory and starts the processes that load the policy."""
    args = _read_checked("model.path", lambda: read_args(cfg.model.path))
    check_policy_rules(cfg, args)
    return args


def load_policy(cfg: Config, path: str | None = None) -> tuple[Transformer, Tokenizer]:
    """The policy of `model.*` (or the model at `path`, e.g. model.ref_path), in eval mode, with the config rules
    that need it checked (policy only); a checkpoint that cannot be read is a ConfigError naming the key."""
    key = "model.path" if path is None else "model.ref_path"
    model, tokenizer = _read_checked(key, lambda: load_model(path or cfg.model.path, dtype=DTYPES[cfg.model.dtype],
                                                             device=cfg.model.device))
    if path is None:
        check_policy_rules(cfg, model.args)
        model.inference_dtype = packed_dtype(cfg.model.inference_dtype, next(model.parameters()).dtype, exact=True)
    return model.eval(), tokenizer
