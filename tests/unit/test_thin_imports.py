"""The modules a thin Flyte task needs import without torch, transformers, vLLM or peft (issue 29: a
resident run's iteration tasks send a request to a long-lived service, so their pods start in seconds
on a CPU node). Checked in a fresh interpreter, so a library some other test imported earlier cannot
hide the answer: one interpreter for all the modules, then, only when one of them loads a heavy
library, one per module to name it and the imports that led there (``python
benchmarks/bench_thin_imports.py`` prints what each costs)."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
from typing import Dict, List, Sequence

ROOT = pathlib.Path(__file__).resolve().parents[2]

HEAVY = ("torch", "transformers", "vllm", "peft")
"""The libraries a thin task's pod must not import."""

THIN_MODULES = ("models.config", "models.config.io", "models.run.types", "models.run.layout", "models.run.lock",
                "models.data.batch", "models.data.batch_schema", "models.tracking", "models.stages.commit",
                "tasks.batch_type", "models.stages.outputs", "models.stages.services", "models.hosts.resident",
                "tasks.resident", "tasks.iteration")
"""What a thin task imports: the config and its YAML reader, the run's handle, layout and lock, the
RolloutBatch file (its tensor methods import torch when called), MLflow tracking, the commit stage, the
batch's Flyte type, and a resident run's tasks (``tasks/resident.py``: the iteration tasks that call the
services) with what they import, and the commit/evaluate/finish tasks' module."""

PROBE = """
import importlib, json, sys, traceback
HEAVY, ROOT = sys.argv[1].split(","), sys.argv[2]
chains = {}

class Witness:
    '''Records, at the first import of a heavy library, the product's lines that led there.'''
    def find_spec(self, name, path=None, target=None):
        if name in HEAVY and name not in chains:
            chains[name] = [f"{f.filename[len(ROOT) + 1:]}:{f.lineno}" for f in traceback.extract_stack()
                            if f.filename.startswith(ROOT + "/") and "site-packages" not in f.filename]
        return None

sys.meta_path.insert(0, Witness())
for name in sys.argv[3:]:
    importlib.import_module(name)
print(json.dumps({h: chains.get(h, []) for h in HEAVY if h in sys.modules}))
"""


def heavy_after_importing(modules: Sequence[str], root: pathlib.Path = ROOT,
                          heavy: Sequence[str] = HEAVY) -> Dict[str, List[str]]:
    """Import ``modules`` in a fresh interpreter with ``root`` first on the path: each ``heavy`` library then
    loaded, with the chain of ``path:line`` (outermost first) that first imported it."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", PROBE, ",".join(heavy), str(root), *modules], cwd=root, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def offenders(modules: Sequence[str], root: pathlib.Path = ROOT, heavy: Sequence[str] = HEAVY) -> List[str]:
    """One line per module whose import alone loads a ``heavy`` library, naming the first importer chain;
    empty when importing all of them together loads none (one interpreter in the usual case)."""
    if not heavy_after_importing(modules, root, heavy):
        return []
    out = []
    for module in modules:
        loaded = heavy_after_importing([module], root, heavy)
        out += [f"{module} loads {lib} via {' -> '.join(chain) or '(outside the product)'}"
                for lib, chain in loaded.items()]
    return out


def test_thin_task_modules_import_without_torch_or_vllm():
    found = offenders(THIN_MODULES)
    assert not found, "a thin task's modules must import none of " + ", ".join(HEAVY) + ":\n" + "\n".join(found)


GRAPH_MODULES = ("workflows.ppo", "workflows.reinforce", "tasks.run_tasks")
"""What a pod that compiles or sets up the graph imports (a dynamic workflow's, ``prepare_run``), and every ``pyflyte
run``: torch is allowed (the elastic tasks' plugin, flytekitplugins-kfpytorch, imports it as it defines them), the
model libraries not; transformers alone (with scikit-learn, which it loads) took about 5 of the 9 s such a pod spent
importing on the 2-core machine (2026-11-27)."""


def test_a_graph_pod_imports_no_model_library():
    found = offenders(GRAPH_MODULES, heavy=HEAVY[1:])
    assert not found, "the graph's modules must import none of " + ", ".join(HEAVY[1:]) + ":\n" + "\n".join(found)


def test_the_check_names_a_module_loading_torch_and_the_chain(tmp_path):
    """It can fail: a module importing torch through another one is named, with both lines. (The torch
    here is an empty package first on the path, which spares loading the real one.)"""
    for package in ("thin_pkg", "torch"):
        (tmp_path / package).mkdir()
        (tmp_path / package / "__init__.py").write_text("")
    (tmp_path / "thin_pkg" / "light.py").write_text("import json\n")
    (tmp_path / "thin_pkg" / "uses.py").write_text("import os\n\nfrom thin_pkg import maths\n")
    (tmp_path / "thin_pkg" / "maths.py").write_text('"""Tensors."""\nimport torch\n')
    found = offenders(["thin_pkg.light", "thin_pkg.uses"], tmp_path)
    assert found == ["thin_pkg.uses loads torch via thin_pkg/uses.py:3 -> thin_pkg/maths.py:2"]


def test_the_configs_copy_of_the_engines_limits_is_the_engines():
    """``models/config/engine_limits.py`` repeats two limits of the engines, so that the config's checks
    load no engine (``models.engines`` starts torch): the two must say the same."""
    from models import engines
    from models.config import engine_limits

    assert engine_limits.MIN_ENGINE_TEMPERATURE == engines.MIN_ENGINE_TEMPERATURE
    assert engine_limits.VLLM_MAX_LORA_RANK == engines.VLLM_MAX_LORA_RANK
