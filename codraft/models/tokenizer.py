"""Tokenizer: a `tokenizers.Tokenizer` plus the checkpoint's special tokens and Jinja chat template.

Built from a Hugging Face directory (tokenizer.json + tokenizer_config.json [+ chat_template.jinja])
or from GGUF metadata (vocabulary, merges and token types as llama.cpp stores them). Behaviour
follows transformers' tokenizers so that token ids and rendered prompts match theirs.
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as Backend

# llama.cpp token types (tokenizer.ggml.token_type)
_CONTROL, _USER_DEFINED = 3, 4

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _regex_then_bytes(pattern: str) -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(pattern), behavior="isolated"), pre_tokenizers.ByteLevel(False, use_regex=False)]
    )


def _gguf_pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    """The split llama.cpp applies for `tokenizer.ggml.pre` (llama-vocab.cpp), as a `tokenizers` pre-tokenizer."""
    gpt2 = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    table = {
        "default": gpt2,
        "gpt-2": gpt2,
        # StarCoder / SmolLM: every digit on its own, then GPT-2's split
        "smollm": pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), gpt2]),
        "starcoder": pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), gpt2]),
        "llama-bpe": _regex_then_bytes(_LLAMA3_SPLIT),
        "llama3": _regex_then_bytes(_LLAMA3_SPLIT),
        "qwen2": _regex_then_bytes(_QWEN2_SPLIT),
    }
    if pre not in table:
        raise ValueError(f"GGUF tokenizer.ggml.pre={pre!r} is not supported; valid: {', '.join(table)}")
    return table[pre]


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map, the alphabet byte-level BPE vocabularies are spelled in."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    mapping = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


def _token_content(token: Any) -> str | None:
    """tokenizer_config.json spells a special token as a string or an AddedToken dict."""
    return token.get("content") if isinstance(token, dict) else token


class _GenerationTag(Extension):
    """`{% generation %}` marks assistant spans for transformers' masks; here it renders its body unchanged."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None, sort_keys: bool = False
) -> str:
    # Jinja's own tojson escapes HTML characters, which chat templates do not want
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


class Tokenizer:
    """Text <-> token ids, and chat messages -> prompt text."""

    def __init__(
        self,
        backend: Backend,
        *,
        chat_template: str | None = None,
        bos_token: str | None = None,
        eos_token: str | None = None,
        pad_token: str | None = None,
        eos_token_ids: list[int] | None = None,
    ):
        self.backend = backend
        self.chat_template = chat_template
        self.bos_token, self.eos_token, self.pad_token = bos_token, eos_token, pad_token
        self.bos_token_id = self._id(bos_token)
        self.pad_token_id = self._id(pad_token)
        eos_id = self._id(eos_token)
        self.eos_token_ids: list[int] = list(eos_token_ids or ([eos_id] if eos_id is not None else []))

    def _id(self, token: str | None) -> int | None:
        if token is None:
            return None
        token_id = self.backend.token_to_id(token)
        if token_id is None:
            raise ValueError(f"special token {token!r} is not in the vocabulary")
        return token_id

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; `add_special_tokens` adds what the checkpoint's post-processor adds (e.g. BOS)."""
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    @cached_property
    def _template(self) -> jinja2.Template:
        if self.chat_template is None:
            raise ValueError("this tokenizer has no chat_template (tokenizer_config.json / tokenizer.chat_template)")
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, loopcontrols]
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        return env.from_string(self.chat_template)

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kwargs: Any
    ) -> str:
        """Render `messages` with the checkpoint's template, passing what transformers passes.

        Extra keyword arguments reach the template (e.g. `enable_thinking=False` for Qwen3).
        """
        specials = {"bos_token": self.bos_token, "eos_token": self.eos_token, "pad_token": self.pad_token}
        context = {k: v for k, v in specials.items() if v is not None}  # unset tokens stay undefined, as in HF
        return self._template.render(
            messages=messages, add_generation_prompt=add_generation_prompt, **context, **kwargs
        )

    def save(self, path: Path) -> None:
        """Write tokenizer.json + tokenizer_config.json, readable by `from_hf_dir` and by transformers."""
        self.backend.save(str(path / "tokenizer.json"))
        config = {
            "chat_template": self.chat_template,
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
            "pad_token": self.pad_token,
            "eos_token_ids": self.eos_token_ids,
        }
        (path / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False), encoding="utf-8")

    @classmethod
    def from_hf_dir(cls, path: Path) -> Tokenizer:
        """tokenizer.json + tokenizer_config.json (+ chat_template.jinja, which wins, as in transformers)."""
        path = Path(path)
        if not (path / "tokenizer.json").is_file():
            raise FileNotFoundError(f"{path} has no tokenizer.json (only fast tokenizers are supported)")
        backend = Backend.from_file(str(path / "tokenizer.json"))
        config_path = path / "tokenizer_config.json"
        config = json.loads(config_path.read_text(encoding="utf-8")) if config_path.is_file() else {}
        template = config.get("chat_template")
        if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
            template = {t["name"]: t["template"] for t in template}.get("default")
        if (path / "chat_template.jinja").is_file():
            template = (path / "chat_template.jinja").read_text(encoding="utf-8")
        return cls(
            backend,
            chat_template=template,
            bos_token=_token_content(config.get("bos_token")),
            eos_token=_token_content(config.get("eos_token")),
            pad_token=_token_content(config.get("pad_token")),
            eos_token_ids=config.get("eos_token_ids"),
        )

    @classmethod
    def from_gguf_metadata(cls, meta: dict[str, Any]) -> Tokenizer:
        """Byte-level BPE (`tokenizer.ggml.model == "gpt2"`) rebuilt from llama.cpp's metadata."""
        kind = meta.get("tokenizer.ggml.model")
        if kind != "gpt2":
            raise ValueError(f"GGUF tokenizer.ggml.model={kind!r} is not supported; valid: 'gpt2' (byte-level BPE)")
        spelling = bytes_to_unicode()
        alphabet = set(spelling.values())
        tokens: list[str] = meta["tokenizer.ggml.tokens"]
        # a token written outside the byte alphabet (e.g. raw spaces) is respelled byte by byte, as transformers does
        vocab = {
            tok if set(tok) <= alphabet else "".join(spelling[b] for b in tok.encode("utf-8")): i
            for i, tok in enumerate(tokens)
        }
        merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
        backend = Backend(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
        backend.pre_tokenizer = _gguf_pre_tokenizer(meta.get("tokenizer.ggml.pre", "default"))
        backend.decoder = decoders.ByteLevel()

        types = meta.get("tokenizer.ggml.token_type") or []
        # control tokens stay whole and are special; one spelled outside the alphabet is a llama.cpp mislabel
        backend.add_special_tokens(
            [
                AddedToken(tok, normalized=False, special=True)
                for tok, t in zip(tokens, types, strict=False)
                if t == _CONTROL and set(tok) <= alphabet
            ]
        )
        backend.add_tokens(
            [
                AddedToken(tok, normalized=False, special=False)
                for tok, t in zip(tokens, types, strict=False)
                if t == _USER_DEFINED and tok in vocab
            ]
        )

        def token(key: str) -> str | None:
            token_id = meta.get(f"tokenizer.ggml.{key}")
            return None if token_id is None else tokens[token_id]

        bos = token("bos_token_id")
        if meta.get("tokenizer.ggml.add_bos_token") and bos is not None:
            bos_id = meta["tokenizer.ggml.bos_token_id"]
            backend.post_processor = processors.TemplateProcessing(
                single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)]
            )
        return cls(
            backend,
            chat_template=meta.get("tokenizer.chat_template"),
            bos_token=bos,
            eos_token=token("eos_token_id"),
            pad_token=token("padding_token_id"),
        )
