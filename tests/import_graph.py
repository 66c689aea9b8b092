"""The product's import graph, read from the source with ``ast`` (nothing of the product is imported):
every ``import`` and ``from ... import`` statement, top-level or inside a function, is an arrow. Used by
``tests/unit/test_layers.py`` and ``tests/unit/test_floor_plan.py`` (docs/development.md, "The floor plan").

- A file is a module named by its path (``models/training/lora.py`` is ``models.training.lora``); a
  package's ``__init__.py`` is the package's module (``models.storage``).
- ``import a.b`` is an arrow to ``a.b``; ``from a import b`` is an arrow to ``a.b`` when that is a
  module, else to ``a``; relative imports are resolved against the importing module's package.
- Importing ``a.b`` runs ``a/__init__.py`` first, so an arrow to ``a.b`` implies arrows to ``a`` and
  every package above it, and these are arrows of the graph: a cycle through a package's ``__init__``
  is as real at run time as any other. The exception: a package that encloses the importing module
  itself, which Python has started before that module's body runs, so an arrow to it orders nothing.
"""

from __future__ import annotations

import ast
import pathlib
from dataclasses import dataclass
from typing import Dict, Iterable, Iterator, List, Optional, Sequence

ROOT = pathlib.Path(__file__).resolve().parents[1]
PRODUCT = ("workflows", "tasks", "models", "kernels")
"""The product's four layers, top to bottom."""


@dataclass(frozen=True)
class Arrow:
    """``source`` imports ``target`` at ``where`` (``path:line``)."""

    source: str
    target: str
    where: str


def module_files(root: pathlib.Path, folders: Sequence[str] = PRODUCT) -> Dict[str, pathlib.Path]:
    """Every module under ``folders`` of ``root``, by dotted name (a package by its ``__init__.py``)."""
    found = {}
    for folder in folders:
        for path in sorted((root / folder).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def parse(path: pathlib.Path) -> ast.Module:
    return ast.parse(path.read_text(), str(path))


def import_statements(path: pathlib.Path) -> Iterator[ast.stmt]:
    return (node for node in ast.walk(parse(path)) if isinstance(node, (ast.Import, ast.ImportFrom)))


def _from_base(node: ast.ImportFrom, module: str, package: bool) -> str:
    """The absolute module a ``from ... import`` names, its leading dots resolved against ``module``."""
    if node.level == 0:
        return node.module or ""
    anchor = module.split(".") if package else module.split(".")[:-1]
    anchor = anchor[:len(anchor) - (node.level - 1)]
    return ".".join(anchor + ([node.module] if node.module else []))


def imported_names(node: ast.stmt, module: str, package: bool) -> Iterator[str]:
    """The dotted names one statement loads: ``import a.b`` gives ``a.b``, ``from a import b`` gives
    ``a.b`` (:func:`resolve` falls back to ``a`` where ``a.b`` is no module)."""
    if isinstance(node, ast.Import):
        yield from (alias.name for alias in node.names)
        return
    base = _from_base(node, module, package)
    yield from (base if alias.name == "*" else f"{base}.{alias.name}" for alias in node.names)


def resolve(name: str, modules: Iterable[str]) -> Optional[str]:
    """The longest prefix of ``name`` that is one of ``modules`` (``a.b.func`` -> ``a.b``), or None."""
    parts = name.split(".")
    while parts and ".".join(parts) not in modules:
        parts.pop()
    return ".".join(parts) or None


def with_packages(target: str, source: str) -> Iterator[str]:
    """``target`` and the packages above it whose ``__init__`` importing it runs, less those that
    enclose ``source`` (started before ``source`` runs)."""
    parts = target.split(".")
    yield target
    for end in range(len(parts) - 1, 0, -1):
        package = ".".join(parts[:end])
        if not source.startswith(package + "."):
            yield package


def module_arrows(root: pathlib.Path = ROOT, folders: Sequence[str] = PRODUCT) -> List[Arrow]:
    """Every arrow between modules of ``folders``, the implied package arrows included."""
    modules = module_files(root, folders)
    arrows = set()
    for source, path in modules.items():
        for node in import_statements(path):
            where = f"{path.relative_to(root)}:{node.lineno}"
            for name in imported_names(node, source, path.name == "__init__.py"):
                target = resolve(name, modules)
                if target is not None:
                    arrows.update(Arrow(source, t, where) for t in with_packages(target, source) if t != source)
    return sorted(arrows, key=lambda a: (a.source, a.target, where_key(a.where)))


def where_key(where: str) -> tuple:
    path, _, line = where.rpartition(":")
    return path, int(line)


def explicit(arrows: Sequence[Arrow]) -> List[Arrow]:
    """The arrows as the statements name them, in source order: less the implied ones to the packages
    above a target of the same statement (for messages; the graph keeps them)."""
    named: Dict[tuple, set] = {}
    for a in arrows:
        named.setdefault((a.source, a.where), set()).add(a.target)
    return sorted((a for a in arrows if not any(t.startswith(a.target + ".") for t in named[a.source, a.where])),
                  key=lambda a: (where_key(a.where), a.target))


def strongly_connected(arrows: Sequence[Arrow]) -> List[List[str]]:
    """The strongly connected components of more than one module (Tarjan 1972, iterative), each sorted."""
    succ: Dict[str, List[str]] = {}
    for a in arrows:
        succ.setdefault(a.source, []).append(a.target)
        succ.setdefault(a.target, [])
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on_stack = set()
    found = []
    for start in sorted(succ):
        if start in index:
            continue
        work = [(start, iter(succ[start]))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, rest = work[-1]
            nxt = next(rest, None)
            if nxt is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while not component or component[-1] != node:
                        component.append(stack.pop())
                        on_stack.discard(component[-1])
                    if len(component) > 1:
                        found.append(sorted(component))
            elif nxt not in index:
                index[nxt] = low[nxt] = len(index)
                stack.append(nxt)
                on_stack.add(nxt)
                work.append((nxt, iter(succ[nxt])))
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
    return sorted(found)


def cycle_through(component: Sequence[str], arrows: Sequence[Arrow]) -> List[Arrow]:
    """A shortest cycle through the component's first module, as its arrows (breadth-first search
    inside the component; the first arrow's ``where`` for each pair of modules)."""
    inside = set(component)
    first: Dict[tuple, Arrow] = {}
    for a in arrows:
        if a.source in inside and a.target in inside:
            first.setdefault((a.source, a.target), a)
    start = component[0]
    came: Dict[str, Arrow] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for node in frontier:
            for (s, t), arrow in first.items():
                if s != node or t in came:
                    continue
                came[t] = arrow
                if t == start:
                    return _walk_back(came, start)
                nxt.append(t)
        frontier = nxt
    raise AssertionError(f"no cycle through {start} in {component}")


def _walk_back(came: Dict[str, Arrow], start: str) -> List[Arrow]:
    path = [came[start]]
    while path[-1].source != start:
        path.append(came[path[-1].source])
    return path[::-1]


def cycle_text(cycle: Sequence[Arrow]) -> str:
    """``a -> b -> a`` with where each arrow is: ``a -> b (a.py:3) -> a (b.py:9)``."""
    return cycle[0].source + "".join(f" -> {a.target} ({a.where})" for a in cycle)


def import_cycles(root: pathlib.Path = ROOT, folders: Sequence[str] = PRODUCT) -> List[str]:
    """One readable cycle per strongly connected component of the graph (none: no cycle)."""
    arrows = module_arrows(root, folders)
    return [f"{cycle_text(cycle_through(c, arrows))} [cycle among {', '.join(c)}]"
            for c in strongly_connected(arrows)]
