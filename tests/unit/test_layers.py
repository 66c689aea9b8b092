"""Layers import only downward (README, docs/design.md): ``workflows/`` → ``tasks/`` → ``models/`` →
``kernels/``. Read from the source (every import statement, top-level or inside a function), so a
lazy import that reaches up is caught too."""

from __future__ import annotations

import ast
import pathlib
from typing import Iterator, Tuple

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
ABOVE = {"kernels": ("models", "tasks", "workflows"), "models": ("tasks", "workflows"), "tasks": ("workflows",)}


def imported_modules(path: pathlib.Path) -> Iterator[Tuple[int, str]]:
    """``(line, module)`` of every absolute import in one file."""
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            yield from ((node.lineno, a.name) for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.lineno, node.module


def upward_imports(layer: str) -> list:
    return [f"{path.relative_to(ROOT)}:{line} imports {module}"
            for path in sorted((ROOT / layer).rglob("*.py"))
            for line, module in imported_modules(path)
            if module.split(".")[0] in ABOVE[layer]]


@pytest.mark.parametrize("layer", sorted(ABOVE))
def test_layer_imports_only_downward(layer):
    assert upward_imports(layer) == []


def test_the_check_sees_an_upward_import(tmp_path, monkeypatch):
    """The check itself can fail: a models/ file with a lazy ``from tasks...`` import is reported."""
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "x.py").write_text("def f():\n    from tasks.rollout import rollout\n")
    monkeypatch.setattr(__import__(__name__, fromlist=["ROOT"]), "ROOT", tmp_path)
    assert upward_imports("models") == ["models/x.py:2 imports tasks.rollout"]
