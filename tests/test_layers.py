"""The package's layers, checked: imports only ever point down.

    5  stopline.cli, stopline.replay, stopline.testing   (the top: people and tests)
    4  stopline.worker                                    (wiring: plugin, workers, codec)
    3  stopline.activities                                (all I/O)
    2  stopline.workflows                                 (deterministic code)
       stopline.testing.scripted                          (stdlib only: hosts serve scenarios)
    1  stopline.settings, stopline.logging,              (configuration)
       stopline.secrets
    0  stopline.core                                      (pure: contracts, policies, refusal)

Activities and workflows sit side by side above the configuration: workflows
reach activities only by their names (``stopline.core.contracts``), and
activities never import workflow code. Every import counts, including the
ones inside functions (lazy imports are still dependencies). Module-level
imports must also form no cycle.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "stopline"

LAYERS = {
    "stopline.core": 0,
    "stopline.settings": 1,
    "stopline.logging": 1,
    "stopline.secrets": 1,
    "stopline.workflows": 2,
    "stopline.activities": 2,
    "stopline.worker": 4,
    "stopline.cli": 5,
    "stopline.replay": 5,
    "stopline.testing": 5,
    # the scripted provider server: stdlib only, and served by hosts for
    # `scripted:FILE` models (stopline.activities.scripted_models)
    "stopline.testing.scripted": 2,
    "stopline": 5,  # the package's public face re-exports from everywhere
}
#: Same layer, still forbidden both ways.
SIDE_BY_SIDE = {("stopline.workflows", "stopline.activities"), ("stopline.activities", "stopline.workflows")}


def _module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _layer_of(module: str) -> tuple[str, int] | None:
    best: tuple[str, int] | None = None
    for prefix, layer in LAYERS.items():
        if module == prefix or module.startswith(prefix + "."):
            if best is None or len(prefix) > len(best[0]):
                best = (prefix, layer)
    return best


def _imports(path: Path, *, top_level_only: bool) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text(), filename=str(path))
    me = _module_name(path)
    package = me if path.name == "__init__.py" else me.rsplit(".", 1)[0]
    found: list[tuple[int, str]] = []
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    for node in nodes:
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                mod = f"{base}.{node.module}" if node.module else base
            else:
                mod = node.module or ""
            # ``from stopline.core import policies`` imports the submodule;
            # ``from stopline.core.contracts import X`` the module itself
            subs = [f"{mod}.{a.name}" for a in node.names if f"{mod}.{a.name}" in _all_modules()]
            found += [(node.lineno, m) for m in subs] or [(node.lineno, mod)]
        elif top_level_only and isinstance(node, (ast.If, ast.With, ast.Try)):
            for child in ast.walk(node):
                if isinstance(child, ast.ImportFrom) and child.module and not child.level:
                    found.append((child.lineno, child.module))
    return [(line, mod) for line, mod in found if mod == "stopline" or mod.startswith("stopline.")]


@functools.cache
def _all_modules() -> frozenset[str]:
    return frozenset(_module_name(p) for p in _files())


def _files() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if "data" not in p.relative_to(PACKAGE).parts[:1])


def test_every_import_points_down() -> None:
    problems = []
    for path in _files():
        me = _module_name(path)
        mine = _layer_of(me)
        assert mine is not None, f"{me} is in no layer: add it to LAYERS"
        for line, target in _imports(path, top_level_only=False):
            theirs = _layer_of(target)
            if theirs is None or theirs[0] == mine[0]:
                continue
            if (mine[0], theirs[0]) in SIDE_BY_SIDE or theirs[1] > mine[1]:
                problems.append(f"{me}:{line} imports {target} (layer {theirs[1]} > {mine[1]})")
    assert not problems, "imports running up the layers:\n" + "\n".join(problems)


def test_module_level_imports_form_no_cycle() -> None:
    graph: dict[str, set[str]] = {}
    modules = {_module_name(p) for p in _files()}
    for path in _files():
        me = _module_name(path)
        graph[me] = {t for _, t in _imports(path, top_level_only=True) if t in modules and t != me}
    seen: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> None:
        seen[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if seen.get(nxt) == 1:
                cycle = stack[stack.index(nxt):] + [nxt]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if nxt not in seen:
                visit(nxt)
        stack.pop()
        seen[node] = 2

    for module in sorted(graph):
        if module not in seen:
            visit(module)


def test_the_checker_catches_an_upward_import(tmp_path: Path) -> None:
    """The check can fail: a core module importing the worker is reported."""
    bad = PACKAGE / "core" / "_layer_probe.py"
    bad.write_text("from stopline.worker.runtime import connect\n")
    try:
        try:
            test_every_import_points_down()
        except AssertionError as err:
            assert "stopline.core._layer_probe" in str(err)
        else:
            raise AssertionError("an upward import went unnoticed")
    finally:
        bad.unlink()
