"""The config reference that `codraft <command> --help` prints: every key of the sections a command reads, with
its type, its default and the comment written after its field in config.py (read from the source, so the two
never disagree)."""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import io
import json
import textwrap
import tokenize
import types
import typing
from typing import Any, Literal

from codraft.config import Config


@dataclasses.dataclass(frozen=True)
class KeyDoc:
    key: str  # dotted, e.g. "rl.steps"
    type: str  # e.g. "int", "float | None", "token-mean|sequence-mean|dr-grpo"
    default: str  # as it would be written in YAML
    comment: str  # the field's trailing `# comment`, or ""


@functools.cache
def _source_docs(cls: type) -> tuple[str, dict[str, str]]:
    """(the class docstring's first line, field name -> its trailing comment) from the source of `cls`."""
    source = textwrap.dedent(inspect.getsource(cls))
    comments = {tok.start[0]: tok.string.lstrip("#").strip()
                for tok in tokenize.generate_tokens(io.StringIO(source).readline) if tok.type == tokenize.COMMENT}
    (node,) = ast.parse(source).body
    fields = {f.target.id: comments.get(f.end_lineno, "") for f in node.body
              if isinstance(f, ast.AnnAssign) and isinstance(f.target, ast.Name)}
    return (ast.get_docstring(node) or "").split("\n")[0], fields


def type_name(tp: Any) -> str:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Literal:
        return "|".join(map(str, args))
    if origin in (types.UnionType, typing.Union):
        return " | ".join(type_name(a) for a in args)
    if origin is list:
        return f"list[{type_name(args[0])}]"
    return "None" if tp is type(None) else tp.__name__


def _yaml(value: Any) -> str:
    return value if isinstance(value, str) and value else json.dumps(value)


def section_keys(section: str) -> list[KeyDoc]:
    """Every key of the config section `section` (a field of Config)."""
    defaults = getattr(Config(), section)
    _, comments = _source_docs(type(defaults))
    return [KeyDoc(f"{section}.{name}", type_name(tp), _yaml(getattr(defaults, name)), comments.get(name, ""))
            for name, tp in typing.get_type_hints(type(defaults)).items()]


def config_reference(sections: tuple[str, ...]) -> str:
    """The help text listing `sections` and their keys, aligned in columns."""
    keys = {s: section_keys(s) for s in sections}
    rows = [(k.key, f"{k.type} = {k.default}", k.comment) for ks in keys.values() for k in ks]
    width = [max(len(r[i]) for r in rows) for i in (0, 1)]
    lines = ["config keys (set them as key=value, or in --config FILE.yaml; `codraft config` prints them resolved):"]
    for section, ks in keys.items():
        doc, _ = _source_docs(type(getattr(Config(), section)))
        lines.append(f"  {section}:" + (f"  {doc}" if doc else ""))
        lines += [f"    {k.key:<{width[0]}}  {f'{k.type} = {k.default}':<{width[1]}}  {k.comment}".rstrip() for k in ks]
    return "\n".join(lines)
