"""Dependencies run one way (DESIGN.md, "Layers of the house"): no module of codraft imports, at any depth
(module level, inside functions, under TYPE_CHECKING), a module of a higher layer. Checked by parsing every
file's imports with `ast`, so a lazy import cannot hide a cycle."""

from __future__ import annotations

import ast
from pathlib import Path

import codraft

# lowest first; a module may import its own layer and the ones below it
LAYERS = [
    # shared leaves: typed config, files, logging, signals, host memory
    ("config", "jsonl", "observability", "interrupt", "host_memory"),
    ("models",),
    ("attention",),
    ("rollout",),
    ("drafts",),
    ("rl",),  # losses, tasks, rewards, batches: no distributed code
    ("distill",),  # draft distillation on the frozen policy (the trainer's checkpoint.draft_init=auto uses it)
    ("parallel",),  # mesh, sharding, ring/USP, pipeline stages, TapChannel, collectives, clip
    ("train",),  # the one train step, the joint objective, optimizers, reference, checkpoints
    ("bench",),
    ("commands", "cli", "config_help", "__main__"),
]
LEVEL = {name: i for i, names in enumerate(LAYERS) for name in names}
ROOT = Path(codraft.__file__).parent


def _top(module: str) -> str | None:
    """The layer name of a `codraft.x.y` module (None for other packages)."""
    parts = module.split(".")
    return parts[1] if parts[0] == "codraft" and len(parts) > 1 else None


def imports(path: Path, root: Path = ROOT) -> list[tuple[int, str]]:
    """(line, imported module) of every codraft import in the file under package dir `root`, relative ones
    resolved."""
    package = ".".join(path.relative_to(root.parent).with_suffix("").parts[:-1])
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join([*package.split(".")[: len(package.split(".")) - node.level + 1], base]).rstrip(".")
            found += [(node.lineno, f"{base}.{alias.name}" if base == "codraft" else base) for alias in node.names]
    return [(line, m) for line, m in found if m.startswith("codraft")]


def test_every_module_of_the_package_has_a_layer():
    tops = {p.relative_to(ROOT).parts[0].removesuffix(".py") for p in ROOT.rglob("*.py")} - {"__init__"}
    assert tops <= LEVEL.keys(), tops - LEVEL.keys()


def test_no_module_imports_from_a_layer_above_it():
    upward = []
    for path in sorted(ROOT.rglob("*.py")):
        here = path.relative_to(ROOT).parts[0].removesuffix(".py")
        if here == "__init__":
            continue
        for line, module in imports(path):
            there = _top(module)
            if there is not None and LEVEL[there] > LEVEL[here]:
                upward.append(f"{path.relative_to(ROOT.parent)}:{line} ({here}) imports {module} ({there})")
    assert not upward, "imports that run up the layering:\n" + "\n".join(upward)


def test_the_checker_sees_lazy_and_relative_imports(tmp_path):
    probe = tmp_path / "codraft" / "rl" / "probe.py"
    probe.parent.mkdir(parents=True)
    probe.write_text("def f():\n    from codraft.train import trainer\n    from ..commands import train\n")
    assert [m for _, m in imports(probe, tmp_path / "codraft")] == ["codraft.train", "codraft.commands"]
