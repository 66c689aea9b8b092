"""The core (``models/``) loads no flytekit: the stage functions of ``models/stages/`` can run outside
Flyte (a long-lived service calls the same functions the tasks call). Checked in a fresh interpreter,
so a flytekit some other test imported earlier cannot hide or fake the answer."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]

PROBE = """
import importlib, json, sys
for name in sys.argv[1:]:
    importlib.import_module(name)
print(json.dumps(sorted(m for m in sys.modules if m == "flytekit" or m.startswith("flytekit."))[:3]))
"""


def flytekit_loaded_by(*modules: str) -> list:
    """The first flytekit modules (sorted) loaded by importing ``modules`` in a fresh interpreter."""
    out = subprocess.run([sys.executable, "-c", PROBE, *modules], cwd=ROOT, capture_output=True, text=True,
                         timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def core_modules() -> list:
    """Every module under ``models/`` (``__main__`` modules are programs, not imported)."""
    names = []
    for path in sorted((ROOT / "models").rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        if parts[-1] == "__main__":
            continue
        names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return names


def test_the_stages_and_the_whole_core_import_without_flytekit():
    modules = core_modules()
    assert "models.stages" in modules and "models.stages.score" in modules
    assert flytekit_loaded_by("models.stages", *modules) == []


def test_the_probe_sees_flytekit_loaded():
    """The check can fail: a task module (a Flyte adapter) loads flytekit."""
    assert flytekit_loaded_by("models.stages", "tasks.advantages") != []
