"""Workflow code is deterministic: no I/O modules, clocks or randomness.

Scans ``stopline/workflows/`` and the pure core ``stopline/core/`` (both run
inside the workflow sandbox) — AST, not grep, so comments and strings do not
count — for forbidden imports and calls.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "stopline"
SCANNED = (PACKAGE / "workflows", PACKAGE / "core")
FORBIDDEN_MODULES = {"httpx", "os", "time", "random", "socket", "subprocess", "requests", "threading"}
FORBIDDEN_CALLS = {("datetime", "now"), ("datetime", "utcnow"), ("date", "today"), ("uuid", "uuid4")}


def _files() -> list[Path]:
    return sorted(p for d in SCANNED for p in d.rglob("*.py"))


@pytest.mark.parametrize("path", _files(), ids=lambda p: f"{p.parent.name}/{p.name}")
def test_workflow_module_has_no_nondeterministic_imports_or_calls(path: Path) -> None:
    tree = ast.parse(path.read_text(), filename=str(path))
    problems: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] in FORBIDDEN_MODULES:
                    problems.append(f"line {node.lineno}: import {alias.name}")
        elif isinstance(node, ast.ImportFrom) and node.module:
            if node.module.split(".")[0] in FORBIDDEN_MODULES:
                problems.append(f"line {node.lineno}: from {node.module} import ...")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            base = node.func.value
            name = base.id if isinstance(base, ast.Name) else getattr(base, "attr", None)
            if (name, node.func.attr) in FORBIDDEN_CALLS:
                problems.append(f"line {node.lineno}: {name}.{node.func.attr}()")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "open":
            problems.append(f"line {node.lineno}: open()")
    assert not problems, f"{path.name}: " + "; ".join(problems)


def test_scan_finds_workflow_files() -> None:
    names = {p.name for p in _files()}
    assert {"agent_task.py", "contracts.py", "policies.py", "refusal.py"} <= names


def test_scanner_catches_a_forbidden_call(tmp_path: Path) -> None:
    """The check can fail: a module calling datetime.now() is flagged."""
    bad = "import datetime\nx = datetime.datetime.now()\nimport httpx\n"
    tree = ast.parse(bad)
    found = [n for n in ast.walk(tree) if isinstance(n, ast.Call)
             and isinstance(n.func, ast.Attribute) and n.func.attr == "now"]
    imports = [n for n in ast.walk(tree) if isinstance(n, ast.Import)
               and n.names[0].name in FORBIDDEN_MODULES]
    assert found and imports
