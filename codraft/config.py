"""Typed config: a tree of dataclasses with defaults, loaded from YAML and overridden by ``key.sub=value``.

Adding a section is adding a dataclass field to ``Config``. Every leaf is type-checked from its
annotation (int, float, bool, str, ``Literal[...]``, ``X | None``, ``list[X]``) and each section
may define ``validate()`` for range checks. User errors are one-line ``ConfigError``s that name
the dotted key and what would be valid.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import functools
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TypeVar

import yaml


class ConfigError(ValueError):
    """A user error in the config: one line, naming the key and what is valid."""


def require(ok: bool, key: str, rule: str, value: Any) -> None:
    """Range check for ``validate()`` hooks: ``config key 'k' must be <rule> (got v)``."""
    if not ok:
        raise ConfigError(f"config key '{key}' must be {rule} (got {value!r})")


@dataclass
class RunConfig:
    dir: str | None = None  # None: runs/<command>-<timestamp>, resolved by prepare_run_dir
    seed: int = 0
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    tensorboard: bool = True


@dataclass
class ModelConfig:
    path: str = "smollm2-135m"  # a preset name, an HF checkpoint dir or a .gguf file
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    device: str = "cpu"

    def validate(self) -> None:
        if Path(self.path).expanduser().exists():
            return
        from codraft.models.presets import PRESETS  # lazy: the model package is heavy

        if self.path not in PRESETS:
            raise ConfigError(
                f"model.path: {self.path!r} is neither a preset ({', '.join(PRESETS)}) "
                "nor an existing file or directory"
            )


@dataclass
class GenerateConfig:
    max_new_tokens: int = 128
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    num_speculative_tokens: int = 4
    drafter: Literal["none", "ngram", "eagle3", "dflash", "dspark"] = "none"
    adaptive: bool = True  # adapt the number of speculative tokens to the acceptance rate
    batch_size: int = 8
    chat_template: bool = True
    prompt: str | None = None  # one prompt; or
    prompts_file: str | None = None  # JSONL with a "prompt" field per line
    draft_path: str | None = None  # exported draft directory, for learned drafters

    def validate(self) -> None:
        if self.prompts_file is not None and not Path(self.prompts_file).is_file():
            raise ConfigError(f"generate.prompts_file: '{self.prompts_file}' is not a file")
        if self.drafter in ("eagle3", "dflash", "dspark") and self.draft_path is None:
            raise ConfigError(
                f"generate.draft_path is required for generate.drafter={self.drafter} "
                "(an exported draft directory, e.g. from `codraft draft-train`)"
            )
        require(self.max_new_tokens >= 1, "generate.max_new_tokens", ">= 1", self.max_new_tokens)
        require(self.temperature >= 0, "generate.temperature", ">= 0", self.temperature)
        require(0 < self.top_p <= 1, "generate.top_p", "in (0, 1]", self.top_p)
        require(self.top_k >= 0, "generate.top_k", ">= 0 (0 = off)", self.top_k)
        require(
            self.num_speculative_tokens >= 0, "generate.num_speculative_tokens", ">= 0", self.num_speculative_tokens
        )
        require(self.batch_size >= 1, "generate.batch_size", ">= 1", self.batch_size)


@dataclass
class ParallelConfig:
    dp: int = 1
    pp: int = 1
    cp: int = 1

    def validate(self) -> None:
        for name in ("dp", "pp", "cp"):
            require(getattr(self, name) >= 1, f"parallel.{name}", ">= 1", getattr(self, name))


@dataclass
class BenchConfig:
    benchmark: Literal["rollout", "attention", "draft", "e2e", "tapchannel"] = "rollout"
    out_dir: str = "results"
    batch_sizes: list[int] = field(default_factory=lambda: [1, 8, 32])
    max_new_tokens: int = 48
    repeats: int = 3  # interleaved repeats; medians are reported
    num_speculative_tokens: int = 4

    def validate(self) -> None:
        require(all(b >= 1 for b in self.batch_sizes), "bench.batch_sizes", "all >= 1", self.batch_sizes)
        require(self.repeats >= 1, "bench.repeats", ">= 1", self.repeats)
        require(self.max_new_tokens >= 2, "bench.max_new_tokens", ">= 2", self.max_new_tokens)


@dataclass
class Config:
    run: RunConfig = field(default_factory=RunConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    generate: GenerateConfig = field(default_factory=GenerateConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    bench: BenchConfig = field(default_factory=BenchConfig)


# --- loading -------------------------------------------------------------------------------

C = TypeVar("C")


def load_config(yaml_path: str | Path | None, overrides: list[str], cls: type[C] = Config) -> C:
    """Defaults of ``cls``, then the YAML file, then ``key.sub=value`` overrides; checked and validated."""
    cfg = cls()
    if yaml_path is not None:
        try:
            data = yaml.safe_load(Path(yaml_path).read_text())
        except OSError as e:
            raise ConfigError(f"cannot read config file '{yaml_path}': {e.strerror}") from None
        except yaml.YAMLError as e:
            raise ConfigError(f"config file '{yaml_path}' is not valid YAML: {' '.join(str(e).split())}") from None
        _merge(cfg, data or {}, "")
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {item!r} must look like key=value (e.g. generate.temperature=0.7)")
        _set(cfg, key.strip(), value)
    _check(cfg, "")
    return cfg


def config_to_dict(cfg: Any) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


def save_config(cfg: Any, path: str | Path) -> None:
    """Write the resolved config as YAML; ``load_config`` reads it back to an equal config."""
    Path(path).write_text(yaml.safe_dump(config_to_dict(cfg), sort_keys=False))


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _is_section(tp: Any) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def _lookup(section: Any, name: str, key: str, prefix: str) -> Any:
    """The annotation of field ``name`` of ``section``; unknown names list the valid ones."""
    hints = _hints(type(section))
    if name not in hints:
        where = f"in '{prefix}'" if prefix else "at top level"
        hint = difflib.get_close_matches(name, hints, n=1)
        did_you_mean = f" (did you mean '{hint[0]}'?)" if hint else ""
        raise ConfigError(f"unknown config key '{key}'; valid keys {where}: {', '.join(hints)}{did_you_mean}")
    return hints[name]


def _merge(section: Any, data: Any, prefix: str) -> None:
    """Copy a YAML mapping into ``section``; leaves are type-checked later by ``_check``."""
    if not isinstance(data, dict):
        where = f"section '{prefix}'" if prefix else "file"
        raise ConfigError(f"config {where} must be a mapping of keys, got {data!r}")
    for name, value in data.items():
        key = f"{prefix}.{name}" if prefix else str(name)
        tp = _lookup(section, str(name), key, prefix)
        if _is_section(tp):
            _merge(getattr(section, name), value or {}, key)  # an empty section in YAML is null
        else:
            setattr(section, name, value)


def _set(cfg: Any, key: str, value: str) -> None:
    section, prefix = cfg, ""
    *path, leaf = key.split(".")
    for name in path:
        tp = _lookup(section, name, key, prefix)
        prefix = f"{prefix}.{name}" if prefix else name
        if not _is_section(tp):
            raise ConfigError(f"config key '{prefix}' is a value, not a section; cannot set '{key}'")
        section = getattr(section, name)
    tp = _lookup(section, leaf, key, prefix)
    if _is_section(tp):
        raise ConfigError(f"config key '{key}' is a section; set one of its keys: {', '.join(_hints(tp))}")
    setattr(section, leaf, value)


def _check(section: Any, prefix: str) -> None:
    """Coerce every leaf to its annotation, then run the section's ``validate()`` hook."""
    for name, tp in _hints(type(section)).items():
        key = f"{prefix}.{name}" if prefix else name
        if _is_section(tp):
            _check(getattr(section, name), key)
        else:
            setattr(section, name, _coerce(getattr(section, name), tp, key))
    if hasattr(section, "validate"):
        section.validate()


_TRUE = ("true", "yes", "on", "1")
_FALSE = ("false", "no", "off", "0")


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """``value`` as type ``tp``: typed values (defaults, YAML) pass through, strings (overrides) are parsed."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Literal:
        for choice in args:
            if value == choice or (isinstance(value, str) and value == str(choice)):
                return choice
        raise ConfigError(f"config key '{key}' must be one of: {', '.join(map(str, args))} (got {value!r})")
    if origin in (types.UnionType, typing.Union):
        (inner,) = [a for a in args if a is not type(None)]  # only `X | None` is supported
        if value is None or (isinstance(value, str) and value.lower() in ("null", "~")):
            return None
        return _coerce(value, inner, key)
    if origin is list:
        if isinstance(value, str):
            with contextlib.suppress(yaml.YAMLError):  # unparsable text is reported below as a type error
                value = yaml.safe_load(value)
        if not isinstance(value, list | tuple):
            raise ConfigError(f"config key '{key}' expects {_type_name(tp)} (e.g. [1, 2]), got {value!r}")
        return [_coerce(v, args[0], f"{key}[{i}]") for i, v in enumerate(value)]
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in _TRUE + _FALSE:
            return value.lower() in _TRUE
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, str):
            try:
                return int(value)
            except ValueError:
                pass
    elif tp is float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)  # also YAML 1.1's unparsed '1e-3'
            except ValueError:
                pass
    elif tp is str:
        if isinstance(value, str):
            return value
    else:
        raise TypeError(f"config key '{key}' has an unsupported annotation {tp!r}")
    raise ConfigError(f"config key '{key}' expects {_type_name(tp)}, got {value!r}")


def _type_name(tp: Any) -> str:
    return tp.__name__ if isinstance(tp, type) and not typing.get_args(tp) else str(tp).replace("typing.", "")
