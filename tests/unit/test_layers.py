"""The package's layers and its import rule (docs/design.md, "Layers"): every import inside `shardpar/`
-- at module level, inside a function, or under TYPE_CHECKING -- goes to the same layer or one below,
and no files import each other in a circle.

    integrations > cli > facade (shardpar/__init__.py) > api > checkpoint > optim > runtime
        > tensor_parallel > sharding > ground (config, config_sources, config_v1, v1_notes, collectives,
          topology, precision)

integrations/ (the Hugging Face Trainer and accelerate front ends) is the top: nothing in shardpar
imports it, and `import shardpar` does not load transformers' Trainer or accelerate.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

PACKAGE_ROOT = Path(__file__).resolve().parents[2] / "shardpar"

# Lowest first. A module belongs to the first layer one of whose prefixes is its name or a parent of it.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    (
        "ground",
        (
            "shardpar.config",
            "shardpar.config_sources",  # where knob values come from: dicts, files, the environment
            "shardpar.config_v1",
            "shardpar.v1_notes",  # the one log line for a v1 name that means something else here
            "shardpar.collectives",
            "shardpar.topology",
            "shardpar.precision",
        ),
    ),
    ("sharding", ("shardpar.sharding",)),
    ("tensor_parallel", ("shardpar.tensor_parallel", "shardpar.nn")),
    ("runtime", ("shardpar.runtime",)),
    ("optim", ("shardpar.optim",)),
    ("checkpoint", ("shardpar.checkpoint",)),
    ("api", ("shardpar.api",)),
    ("facade", ("shardpar",)),
    ("cli", ("shardpar.cli",)),
    ("integrations", ("shardpar.integrations",)),
]


def module_names(root: Path, package: str) -> dict[str, Path]:
    """Dotted module name -> file, for every .py under `root` (a package's __init__ is the package)."""
    names = {}
    for path in sorted(root.rglob("*.py")):
        parts = [package, *path.relative_to(root).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        names[".".join(parts)] = path
    return names


def _imports(tree: ast.AST, module: str, is_package: bool) -> Iterator[tuple[str, str | None]]:
    """(imported module, name taken from it or None) for every import statement anywhere in `tree`."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, None
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative import: resolve against this module's package
                anchor = module.split(".")
                anchor = anchor[: len(anchor) - node.level + (1 if is_package else 0)]
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:
                yield base, alias.name


def import_graph(root: Path, package: str) -> dict[str, set[str]]:
    """Module -> the package modules it imports. `from a import b` names module a.b when b is one."""
    modules = module_names(root, package)
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        targets: set[str] = set()
        for base, taken in _imports(tree, name, path.name == "__init__.py"):
            if taken is not None and f"{base}.{taken}" in modules:
                targets.add(f"{base}.{taken}")
            elif base in modules:
                targets.add(base)
        graph[name] = targets - {name}
    return graph


def layer_of(module: str, layers: list[tuple[str, tuple[str, ...]]]) -> int:
    best, best_len = -1, -1
    for i, (_, prefixes) in enumerate(layers):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best_len:
                best, best_len = i, len(prefix)
    if best < 0:
        raise AssertionError(f"{module} is in no layer; add it to LAYERS")
    return best


def upward_imports(graph: dict[str, set[str]], layers: list[tuple[str, tuple[str, ...]]]) -> list[str]:
    bad = []
    for src, targets in sorted(graph.items()):
        for dst in sorted(targets):
            if layer_of(dst, layers) > layer_of(src, layers):
                bad.append(
                    f"{src} ({layers[layer_of(src, layers)][0]}) imports {dst} ({layers[layer_of(dst, layers)][0]})"
                )
    return bad


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_every_module_has_a_layer() -> None:
    for name in module_names(PACKAGE_ROOT, "shardpar"):
        layer_of(name, LAYERS)


def test_no_import_runs_upward() -> None:
    bad = upward_imports(import_graph(PACKAGE_ROOT, "shardpar"), LAYERS)
    assert not bad, "imports from a lower layer to a higher one:\n" + "\n".join(bad)


def test_no_import_circle() -> None:
    found = circles(import_graph(PACKAGE_ROOT, "shardpar"))
    assert not found, f"import circles: {found}"


def _write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_the_checks_catch_a_circle_and_an_upward_type_only_import(tmp_path: Path) -> None:
    """The checker itself: a circle hidden behind TYPE_CHECKING and a function-local import, and a
    low layer importing a high one, are both found."""
    _write(
        tmp_path / "pkg",
        {
            "__init__.py": "",
            "low/__init__.py": "",
            "low/a.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.high import b\n",
            "high/__init__.py": "",
            "high/b.py": "def f():\n    from pkg.high import c\n",
            "high/c.py": "from . import b\n",
        },
    )
    layers = [("low", ("pkg.low",)), ("top", ("pkg",)), ("high", ("pkg.high",))]
    graph = import_graph(tmp_path / "pkg", "pkg")
    assert upward_imports(graph, layers) == ["pkg.low.a (low) imports pkg.high.b (high)"]
    assert circles(graph) == [["pkg.high.b", "pkg.high.c"]]


@pytest.mark.parametrize(
    ("module", "layer"),
    [
        ("shardpar.collectives.smddp", "ground"),
        ("shardpar.runtime.unit", "runtime"),
        ("shardpar.cli.estimate", "cli"),
        ("shardpar", "facade"),
        ("shardpar.integrations.transformers.trainer", "integrations"),
    ],
)
def test_layer_of(module: str, layer: str) -> None:
    assert LAYERS[layer_of(module, LAYERS)][0] == layer


def test_nothing_imports_the_integrations_and_the_facade_loads_neither_front_end() -> None:
    graph = import_graph(PACKAGE_ROOT, "shardpar")
    users = sorted(
        src
        for src, dst in graph.items()
        if not src.startswith("shardpar.integrations") and any(d.startswith("shardpar.integrations") for d in dst)
    )
    assert not users, f"modules outside integrations/ import it: {users}"
    import subprocess
    import sys

    code = "import sys, shardpar; print(sorted(m for m in ('accelerate', 'transformers.trainer') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", out
