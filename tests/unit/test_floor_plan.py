"""The floor plan as tests (docs/development.md, "The floor plan"): no import cycle among the product's
modules, arrows downward inside ``models/`` and ``tasks/`` as well as between the four layers
(``test_layers.py``), the demos imported by no production module, the core (``models/``, ``kernels/``)
free of flytekit, and the sizes that keep the code readable (issue 28).

Read from the source (``tests/import_graph.py``: every import statement, top-level or inside a function,
so a lazy import is an arrow like any other; an arrow to ``a.b`` also counts as one to the package ``a``,
whose ``__init__`` importing ``a.b`` runs). Nothing of the product is imported here except by the one
``slow`` test, which imports every ``models.*`` module in a fresh interpreter. Each check has a test
that shows it can fail, on a small tree under ``tmp_path``."""

from __future__ import annotations

import ast
import json
import os
import pathlib
import subprocess
import sys
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

import pytest

from tests.import_graph import (ROOT, explicit, import_cycles, import_statements, module_arrows, module_files,
                                parse)

MODEL_FLOORS: Tuple[Tuple[str, ...], ...] = (
    ("demos",),  # the demo presets' builders: tests, benchmarks and `python -m models.demos.*` use them
    ("hosts",),  # what a service holds: the models kept loaded, its ops calling the stage functions whole
    ("stages",),  # one plain function per iteration stage, called by the Flyte tasks (and by services)
    ("run",),  # a run's lifecycle: set-up, preflight checks, resume, layout, lock, end, health
    ("tracking",),  # MLflow: metrics, the model registry, reports
    ("config",),  # TrainConfig: reads the algorithms, checks against the engines' and rewards' limits
    ("algorithms",),  # one declaration per algorithm
    ("service",),  # the service layer: one server, client, launcher, address book, the ops' checks (stages and
    # preflight call services through it; the hosts serve on it)
    ("environments",),  # multi-turn episodes: an engine's turns, a reward at the end
    ("rewards",),  # reward functions, reward models, their workers
    ("training",),  # forwards, the update loop, LoRA, the probe, AdamW's state, distributed set-up
    ("data",),  # the RolloutBatch file and the prompt dataset
    ("engines",),  # vLLM and HF generation engines
    ("checkpoint",),  # committed checkpoints, their cache
    ("storage",),  # local and fsspec storage, compare-and-swap writes
    ("console", "environ", "faults", "library_imports", "memory", "processes", "timing"),  # leaves: console
    # quieting, scoped environment settings, the test-only fault injection, what the libraries need not import,
    # memory given back to the machine, a run's processes
    # (memory, signals, stopping them), phase timing
)
"""The packages (and top-level modules) of ``models/``, top floor first: a module imports only from its
own floor or below. Derived from the imports (``git grep -n "^from models\\|^    from models" models``);
docs/development.md draws it."""

DEMOS = "models.demos"
MAX_MODULE_LINES = 400
MAX_MODELS_TOP_MODULES = 12
MAX_TASK_MODULE_LINES = 600
TASK_DECORATORS = {"task", "dynamic", "eager"}


def floor_index(module: str, floors: Sequence[Tuple[str, ...]] = MODEL_FLOORS) -> Optional[int]:
    """The floor of a ``models.*`` module (0: top), None for ``models`` itself or a module elsewhere, -1
    for a package of ``models/`` that has no floor."""
    parts = module.split(".")
    if parts[0] != "models" or len(parts) == 1:
        return None
    return next((i for i, names in enumerate(floors) if parts[1] in names), -1)


def unplaced_packages(root: pathlib.Path = ROOT, floors=MODEL_FLOORS) -> List[str]:
    return sorted({".".join(m.split(".")[:2]) for m in module_files(root, ("models",))
                   if floor_index(m, floors) == -1})


def floor_name(index: int, floors=MODEL_FLOORS) -> str:
    return "/".join(floors[index])


def upward_model_arrows(root: pathlib.Path = ROOT, floors=MODEL_FLOORS) -> List[str]:
    """``path:line`` of every import in ``models/`` from a floor to a higher one."""
    out = []
    for a in explicit(module_arrows(root, ("models",))):
        src, dst = floor_index(a.source, floors), floor_index(a.target, floors)
        if src is not None and dst is not None and 0 <= dst < src:
            out.append(f"{a.where}: {a.source} (floor {floor_name(src, floors)}) imports {a.target} "
                       f"(floor {floor_name(dst, floors)}, above it)")
    return out


def decorator_names(node: ast.AST) -> Iterator[Optional[str]]:
    """The last name of each decorator of a function: ``@task``, ``@task(...)``, ``@flytekit.task`` -> task."""
    for deco in node.decorator_list if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) else ():
        func = deco.func if isinstance(deco, ast.Call) else deco
        yield func.id if isinstance(func, ast.Name) else getattr(func, "attr", None)


def is_task_module(path: pathlib.Path) -> bool:
    """Whether the file defines a Flyte task (a function decorated ``@task``, ``@dynamic`` or ``@eager``)."""
    return any(name in TASK_DECORATORS for node in ast.walk(parse(path)) for name in decorator_names(node))


def task_modules(root: pathlib.Path = ROOT) -> Dict[str, pathlib.Path]:
    return {name: path for name, path in module_files(root, ("tasks",)).items() if is_task_module(path)}


def support_imports_of_tasks(root: pathlib.Path = ROOT) -> List[str]:
    """Imports from a support module of ``tasks/`` (no task in it) to a module that defines tasks."""
    tasks = task_modules(root)
    return [f"{a.where}: {a.source} (support) imports {a.target} (defines tasks, a floor above)"
            for a in explicit(module_arrows(root, ("tasks",))) if a.source not in tasks and a.target in tasks]


def demo_imports(root: pathlib.Path = ROOT) -> List[str]:
    return [f"{a.where}: {a.source} imports {a.target}" for a in explicit(module_arrows(root))
            if a.target.startswith(DEMOS) and not (a.source + ".").startswith(DEMOS + ".")]


def flytekit_imports(root: pathlib.Path = ROOT, folders: Sequence[str] = ("models", "kernels")) -> List[str]:
    """``path:line`` of every flytekit import (lazy ones included) in ``folders``."""
    out = []
    for path in module_files(root, folders).values():
        for node in import_statements(path):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            out.extend(f"{path.relative_to(root)}:{node.lineno} imports {name}" for name in names
                       if name.split(".")[0] in ("flytekit", "flytekitplugins"))
    return sorted(out)


def line_count(path: pathlib.Path) -> int:
    return len(path.read_text().splitlines())


def long_modules(root: pathlib.Path = ROOT) -> List[str]:
    return [f"{p.relative_to(root)}: {n} lines" for p in module_files(root).values()
            if (n := line_count(p)) > MAX_MODULE_LINES]


def models_top_modules(root: pathlib.Path = ROOT) -> List[str]:
    return sorted(p.name for p in (root / "models").glob("*.py") if p.name != "__init__.py")


def task_module_lines(root: pathlib.Path = ROOT) -> List[Tuple[str, int]]:
    return [(str(p.relative_to(root)), line_count(p)) for p in task_modules(root).values()]


# The rules, on the product.

RULES = {
    "no_import_cycle": (
        import_cycles,
        "import cycles among product modules: neither module can be understood, tested or moved without the other, "
        "and the import order decides which half-initialised module the other sees (a function-level import only "
        "postpones it); move the shared piece down (docs/development.md, \"The floor plan\")"),
    "every_models_package_has_a_floor": (
        unplaced_packages,
        "packages of models/ on no floor: place each in MODEL_FLOORS (and in docs/development.md's floor plan), so "
        "that the floor test can tell which imports point up"),
    "models_imports_only_downward": (
        upward_model_arrows,
        "imports to a higher floor of models/ (MODEL_FLOORS): move the function down, or the importing code up"),
    "task_support_imports_no_task_module": (
        support_imports_of_tasks,
        "a support module of tasks/ imports a module that defines Flyte tasks (the task modules sit above their "
        "support)"),
    "production_imports_no_demo": (
        demo_imports,
        "production code imports models/demos/ (a demo is a preset plus a builder of its model and data; only tests, "
        "benchmarks and the demos' builders use it)"),
    "core_imports_no_flytekit": (
        flytekit_imports,
        "the Flyte-free core (models/, kernels/) imports flytekit; Flyte belongs in tasks/ and workflows/, so that "
        "services and tests run the core without it"),
    "no_module_over_the_line_limit": (
        long_modules,
        f"product modules over {MAX_MODULE_LINES} lines (split by concept; a reader should hold a module in mind)"),
}


@pytest.mark.parametrize("rule", list(RULES))
def test_rule_holds(rule):
    check, reason = RULES[rule]
    found = check()
    assert not found, f"{reason}:\n" + "\n".join(found)


def test_the_service_layer_sits_below_the_stages_and_the_hosts_above():
    """A host calls stage functions with its models; a stage calls a service through the layer: neither the layer
    nor a stage may import a host, and the layer knows no stage (issue 37)."""
    hosts, stages, service = (floor_index(f"models.{name}") for name in ("hosts", "stages", "service"))
    assert hosts < stages < service, [floor_name(i) for i in (hosts, stages, service)]


def test_models_is_no_flat_drawer():
    found = models_top_modules()
    assert len(found) <= MAX_MODELS_TOP_MODULES, \
        f"{len(found)} modules directly in models/, more than {MAX_MODELS_TOP_MODULES} (group them by concept " \
        f"into subpackages): {found}"


def test_task_modules_are_thin_adapters():
    found = task_module_lines()
    total = sum(n for _, n in found)
    assert total <= MAX_TASK_MODULE_LINES, \
        f"the modules that define Flyte tasks hold {total} lines, more than {MAX_TASK_MODULE_LINES} (a task is a " \
        f"decorator, its typed signature and one call to a plain function in models/): " \
        + ", ".join(f"{p} {n}" for p, n in sorted(found))


PROBE = """
import importlib, json, sys
first = None
for name in sys.argv[1:]:
    importlib.import_module(name)
    if first is None and "flytekit" in sys.modules:
        first = name
print(json.dumps({"first": first, "flytekit": sorted(m for m in sys.modules if m.split(".")[0] == "flytekit")[:5]}))
"""


def flytekit_after_importing(root: pathlib.Path, modules: Sequence[str]) -> dict:
    """Import ``modules`` one by one in a fresh interpreter with ``root`` first on the path: the first
    whose import loaded flytekit, and a few of flytekit's modules then loaded."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", PROBE, *modules], cwd=root, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def core_modules(root: pathlib.Path = ROOT) -> List[str]:
    return [m for m in module_files(root, ("models",)) if not m.endswith("__main__")]


@pytest.mark.slow  # a fresh interpreter importing all of models/ (torch, transformers, MLflow): ~10 s of CPU
def test_importing_the_core_loads_no_flytekit():
    found = flytekit_after_importing(ROOT, core_modules())
    assert found["first"] is None, f"importing {found['first']} loaded flytekit ({found['flytekit']}): the " \
                                   f"core must import without it"


# Each check can fail.

def write(root: pathlib.Path, files: dict) -> pathlib.Path:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


def test_the_graph_resolves_each_kind_of_import(tmp_path):
    """``import a.b``, ``from a import b`` (a module, or a name in ``a``), relative imports, and the
    arrow to a package whose ``__init__`` importing one of its modules runs."""
    root = write(tmp_path, {
        "models/__init__.py": "",
        "models/p/__init__.py": "",
        "models/p/a.py": "from . import b\nfrom .b import NAME\nfrom .. import q\n",
        "models/p/b.py": "NAME = 1\n",
        "models/q.py": "def f():\n    import models.p.b\n    from models.p import a\n",
    })
    got = {(a.source, a.target, a.where) for a in module_arrows(root, ("models",))}
    assert got == {("models.p.a", "models.p.b", "models/p/a.py:1"), ("models.p.a", "models.p.b", "models/p/a.py:2"),
                   ("models.p.a", "models.q", "models/p/a.py:3"),
                   ("models.q", "models.p.b", "models/q.py:2"), ("models.q", "models.p", "models/q.py:2"),
                   ("models.q", "models.p.a", "models/q.py:3"), ("models.q", "models.p", "models/q.py:3")}


def test_the_check_sees_a_cycle(tmp_path):
    """Two modules importing each other inside functions, and a cycle that exists only through a
    package's ``__init__`` (importing ``models.p.c`` runs ``models/p/__init__.py``)."""
    root = write(tmp_path, {
        "models/__init__.py": "", "models/a.py": "def f():\n    from models.b import g\n",
        "models/b.py": "import os\n\n\ndef g():\n    from models import a\n",
        "models/p/__init__.py": "from models.r import R\n", "models/p/c.py": "",
        "models/r.py": "R = 1\n\n\ndef h():\n    import models.p.c\n",
    })
    assert import_cycles(root, ("models",)) == [
        "models.a -> models.b (models/a.py:2) -> models.a (models/b.py:5) [cycle among models.a, models.b]",
        "models.p -> models.r (models/p/__init__.py:1) -> models.p (models/r.py:5) [cycle among models.p, models.r]"]


def test_the_check_sees_an_upward_arrow_inside_models(tmp_path):
    root = write(tmp_path, {"models/__init__.py": "",
                            "models/config/__init__.py": "def f():\n    from models.run import x\n",
                            "models/run/__init__.py": "", "models/run/x.py": "", "models/newpkg/__init__.py": ""})
    assert upward_model_arrows(root) == [
        "models/config/__init__.py:2: models.config (floor config) imports models.run.x (floor run, above it)"]
    assert unplaced_packages(root) == ["models.newpkg"]


def test_the_check_sees_support_importing_a_task_module(tmp_path):
    stage = "import flytekit\n\n\n@flytekit.task(retries=1)\ndef t() -> int:\n    return 1\n"
    root = write(tmp_path, {"tasks/__init__.py": "", "tasks/stage.py": stage,
                            "tasks/support.py": "def f():\n    from tasks.stage import t\n"})
    assert list(task_modules(root)) == ["tasks.stage"]
    assert support_imports_of_tasks(root) == [
        "tasks/support.py:2: tasks.support (support) imports tasks.stage (defines tasks, a floor above)"]


def test_the_check_sees_production_importing_a_demo(tmp_path):
    root = write(tmp_path, {"models/__init__.py": "", "models/demos/__init__.py": "", "models/demos/tiny.py": "",
                            "models/demos/preset.py": "from models.demos import tiny\n",
                            "tasks/__init__.py": "", "tasks/x.py": "def f():\n    from models.demos.tiny import T\n"})
    assert demo_imports(root) == ["tasks/x.py:2: tasks.x imports models.demos.tiny"]


def test_the_check_sees_a_flytekit_import(tmp_path):
    lazy = "import os\n\n\ndef f():\n    import flytekit\n    from flytekit.core import task\n"
    root = write(tmp_path, {"models/__init__.py": "", "models/x.py": lazy,
                            "kernels/k.py": "from flytekitplugins.kfpytorch import Elastic\n"})
    assert flytekit_imports(root) == ["kernels/k.py:1 imports flytekitplugins.kfpytorch",
                                      "models/x.py:5 imports flytekit", "models/x.py:6 imports flytekit.core"]


def test_the_checks_see_sizes_over_the_limits(tmp_path):
    long = "x = 1\n" * (MAX_MODULE_LINES + 1)
    task = "from flytekit import task\n\n\n@task\ndef t() -> int:\n    return 1\n" + "\n" * 300
    files = {f"models/m{i}.py": "" for i in range(MAX_MODELS_TOP_MODULES + 1)}
    root = write(tmp_path, {**files, "models/__init__.py": "", "kernels/long.py": long,
                            "tasks/a.py": task, "tasks/b.py": task, "tasks/support.py": long[:-6]})
    assert long_modules(root) == [f"kernels/long.py: {MAX_MODULE_LINES + 1} lines"]
    assert len(models_top_modules(root)) == MAX_MODELS_TOP_MODULES + 1
    assert sorted(task_module_lines(root)) == [("tasks/a.py", 306), ("tasks/b.py", 306)]  # together over 600


@pytest.mark.slow  # a fresh interpreter importing flytekit
def test_the_fresh_interpreter_check_sees_flytekit(tmp_path):
    root = write(tmp_path, {"models/__init__.py": "", "models/a.py": "", "models/b.py": "import flytekit\n",
                            "models/__main__.py": "raise SystemExit('never imported')\n"})
    assert core_modules(root) == ["models", "models.a", "models.b"]
    found = flytekit_after_importing(root, core_modules(root))
    assert found["first"] == "models.b" and "flytekit" in found["flytekit"]
