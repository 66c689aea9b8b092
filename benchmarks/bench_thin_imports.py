"""What importing a task's modules costs in a fresh interpreter, and whether it loads torch or vLLM.

    python benchmarks/bench_thin_imports.py [--repeats 3]

For each module a thin task needs (``THIN_MODULES`` of ``tests/unit/test_thin_imports.py``, which
holds them free of torch, transformers, vLLM and peft), then for the stateless task modules and for
torch alone (the scale): the seconds ``importlib.import_module`` takes in a fresh interpreter (the
interpreter's own start not counted; median of ``--repeats``, each in its own interpreter, so nothing
is cached in memory across them, while the OS page cache stays warm), and which of those libraries
the import left loaded. Prints figures; asserts nothing (issue 29: a thin task's pod starts in seconds).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Sequence

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.unit.test_thin_imports import HEAVY, THIN_MODULES  # noqa: E402

TASK_MODULES = ("tasks.score", "tasks.updates", "tasks.rollout")
"""The stateless mode's task modules: each loads its stage, and so torch (and vLLM for the rollout)."""
SCALE = ("torch",)

CHILD = """
import importlib, json, sys, time
heavy = sys.argv[2].split(",")
start = time.perf_counter()
importlib.import_module(sys.argv[1])
seconds = time.perf_counter() - start
print(json.dumps({"seconds": seconds, "loaded": [h for h in heavy if h in sys.modules]}))
"""


def import_once(module: str) -> Dict:
    """One fresh interpreter importing ``module``: its seconds and the heavy libraries then loaded."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", CHILD, module, ",".join(HEAVY)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"importing {module} failed:\n{proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def measure(module: str, repeats: int) -> Dict:
    runs = [import_once(module) for _ in range(repeats)]
    return {"module": module, "seconds": statistics.median(r["seconds"] for r in runs),
            "runs": [round(r["seconds"], 3) for r in runs], "loaded": runs[-1]["loaded"]}


def print_table(groups: Sequence[tuple], repeats: int) -> None:
    print(f"import seconds in a fresh interpreter (median of {repeats}), and what it loaded of {', '.join(HEAVY)}")
    print(f"{'module':<28} {'median s':>9}  {'runs s':<24} loaded")
    for title, results in groups:
        print(f"-- {title}")
        for r in results:
            runs = " ".join(f"{s:.3f}" for s in r["runs"])
            print(f"{r['module']:<28} {r['seconds']:>9.3f}  {runs:<24} {', '.join(r['loaded']) or '-'}")


def main(argv: List[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3, help="fresh interpreters per module (the median is shown)")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error(f"--repeats must be >= 1, got {args.repeats}")
    groups = [(title, [measure(m, args.repeats) for m in modules])
              for title, modules in (("a thin task's modules", THIN_MODULES), ("the stateless task modules",
                                     TASK_MODULES), ("for scale", SCALE))]
    print_table(groups, args.repeats)


if __name__ == "__main__":
    main()
